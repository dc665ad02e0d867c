//! Reading typed values out of a [`Resolved`] (naming the setting and its source on error), and
//! the checks of names, regions, ids and quantities.

use crate::catalog::{self, InstanceType};

use super::{ConfigError, Resolved, Source, StorageBackend, setting};

/// What a setting's value must be: its row's parser in [`super::SETTINGS`]. Every value given
/// is checked by its row's parser before the project is built, so that a setting's accepted
/// form lives with its key, flag and default; the row then writes the value into its field,
/// and [`super::Project::from_resolved`] checks what depends on several settings.
#[derive(Clone, Copy)]
pub enum Parse {
    /// A value checked as it is read into its field's type ([`super::read::FromSetting`]: a
    /// choice naming its options), or with the settings it depends on (MIN:MAX, the storage
    /// backend, a name whose limit depends on what is named after it).
    Typed,
    Text,
    /// A whole number from 0.
    Number,
    /// A whole number from 1.
    Count,
    /// A TCP port, 1 to 65535.
    Port,
    /// A TCP port, or 0 for none.
    PortOrOff,
    /// Text that `accepts`; otherwise "expected {what}".
    Matches(fn(&str) -> bool, &'static str),
    /// An image reference.
    Image,
    DnsLabel,
    DnsSubdomain,
    /// An s3:// URI, or none.
    S3,
    /// An EC2 instance type of the catalog.
    Instance,
    /// `none`, or a value of the inner parser.
    OrNone(&'static Parse),
}

impl Parse {
    /// Checks the value of `key` (given, as every checked value is).
    pub(super) fn check(&self, v: &Values, key: &'static str) -> Result<(), ConfigError> {
        match self {
            Parse::Typed | Parse::Text => Ok(()),
            Parse::Number => v.number::<u32>(key).map(drop),
            Parse::Count => v.positive(key).map(drop),
            Parse::Port => match v.number::<u16>(key)? {
                0 => Err(v.invalid(key, "must be a port from 1 to 65535".into())),
                _ => Ok(()),
            },
            Parse::PortOrOff => v.number::<u16>(key).map(drop),
            Parse::Matches(accepts, what) => v.matching(key, accepts, what).map(drop),
            Parse::Image => v
                .matching(
                    key,
                    |s| !s.is_empty() && !s.contains(char::is_whitespace),
                    "an image reference such as 123456789012.dkr.ecr.us-west-2.amazonaws.com/trainctl:0.1",
                )
                .map(drop),
            Parse::DnsLabel => v
                .matching(
                    key,
                    |s| is_dns_label(s, 63),
                    "a DNS-1123 label: at most 63 lowercase letters, digits and '-', starting \
                     and ending with a letter or digit",
                )
                .map(drop),
            Parse::DnsSubdomain => v
                .matching(
                    key,
                    |s| s.len() <= 253 && s.split('.').all(|l| is_dns_label(l, 63)),
                    "a DNS-1123 subdomain: lowercase letters, digits, '-' and '.'",
                )
                .map(drop),
            Parse::S3 => v.optional_s3(key).map(drop),
            Parse::Instance => v.instance(key).map(drop),
            Parse::OrNone(inner) => match v.optional(key).as_deref() {
                None | Some("none") => Ok(()),
                Some(_) => inner.check(v, key),
            },
        }
    }
}

/// Reads typed values out of a [`Resolved`], naming the setting and its source on error.
pub(super) struct Values<'a>(pub(super) &'a Resolved);

impl Values<'_> {
    pub(super) fn raw(&self, key: &'static str) -> Option<&(String, Source)> {
        self.0.values.get(key)
    }

    pub(super) fn invalid(&self, key: &'static str, problem: String) -> ConfigError {
        let (value, from) = self
            .raw(key)
            .cloned()
            .unwrap_or((String::new(), Source::Default));
        ConfigError::Invalid {
            key,
            value,
            from,
            problem,
        }
    }

    pub(super) fn str(&self, key: &'static str) -> Result<String, ConfigError> {
        match self.raw(key) {
            Some((v, _)) => Ok(v.trim().to_string()),
            None => Err(self.invalid(key, format!("missing; set {}", flag_of(key)))),
        }
    }

    pub(super) fn optional(&self, key: &'static str) -> Option<String> {
        self.raw(key)
            .map(|(v, _)| v.trim().to_string())
            .filter(|v| !v.is_empty())
    }

    pub(super) fn list(&self, key: &'static str) -> Vec<String> {
        self.optional(key)
            .map(|v| {
                v.split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    }

    pub(super) fn number<T: std::str::FromStr>(&self, key: &'static str) -> Result<T, ConfigError> {
        self.str(key)?
            .parse::<T>()
            .map_err(|_| self.invalid(key, "not a number in range".into()))
    }

    pub(super) fn positive(&self, key: &'static str) -> Result<u32, ConfigError> {
        match self.number::<u32>(key)? {
            0 => Err(self.invalid(key, "must be at least 1".into())),
            n => Ok(n),
        }
    }

    pub(super) fn matching(
        &self,
        key: &'static str,
        ok: impl Fn(&str) -> bool,
        expected: &str,
    ) -> Result<String, ConfigError> {
        let v = self.str(key)?;
        if ok(&v) {
            Ok(v)
        } else {
            Err(self.invalid(key, format!("expected {expected}")))
        }
    }

    /// `text` as an S3 URI (checked as trainctl's S3 client will read it).
    pub(super) fn s3_uri(&self, key: &'static str, text: &str) -> Result<String, ConfigError> {
        match text.parse::<objects::S3Uri>() {
            Ok(_) => Ok(text.to_string()),
            Err(e) => Err(self.invalid(key, format!("{e}"))),
        }
    }

    /// An optional S3 URI; `none` is none.
    pub(super) fn optional_s3(&self, key: &'static str) -> Result<Option<String>, ConfigError> {
        match self.optional(key).as_deref() {
            None | Some("none") => Ok(None),
            Some(text) => self.s3_uri(key, text).map(Some),
        }
    }

    pub(super) fn instance(&self, key: &'static str) -> Result<&'static InstanceType, ConfigError> {
        let name = self.str(key)?;
        catalog::instance_type(&name).ok_or_else(|| {
            let known: Vec<_> = catalog::INSTANCE_TYPES.iter().map(|t| t.name).collect();
            self.invalid(
                key,
                format!("unknown instance type; known: {}", known.join(", ")),
            )
        })
    }

    pub(super) fn nnodes(&self) -> Result<(u32, u32), ConfigError> {
        let v = self.str("job.nnodes")?;
        let (min, max) = v.split_once(':').unwrap_or((&v, &v));
        let parse = |s: &str| s.trim().parse::<u32>().ok().filter(|&n| n > 0);
        match (parse(min), parse(max)) {
            (Some(min), Some(max)) if min <= max => Ok((min, max)),
            (Some(_), Some(_)) => {
                Err(self.invalid("job.nnodes", "MIN is larger than MAX; write MIN:MAX".into()))
            }
            _ => Err(self.invalid(
                "job.nnodes",
                "expected a positive number N or MIN:MAX".into(),
            )),
        }
    }

    pub(super) fn storage_backend(&self) -> Result<Option<StorageBackend>, ConfigError> {
        let efs = self.optional("storage.efs");
        let fsx = self.optional("storage.fsx");
        let host_path = self.optional("storage.host_path");
        let given = [efs.is_some(), fsx.is_some(), host_path.is_some()];
        if given.iter().filter(|g| **g).count() > 1 {
            let key = if host_path.is_some() {
                "storage.host_path"
            } else {
                "storage.fsx"
            };
            return Err(self.invalid(
                key,
                "more than one of storage.efs, storage.fsx and storage.host_path is set; choose one"
                    .into(),
            ));
        }
        if let Some(path) = host_path {
            return if path.starts_with('/') {
                Ok(Some(StorageBackend::HostPath { path }))
            } else {
                Err(self.invalid("storage.host_path", "expected an absolute path".into()))
            };
        }
        match (efs, fsx) {
            (Some(id), _) => {
                // fs-ID, or fs-ID::fsap-ID to mount through an access point (which can own the
                // files as the pods' user, 1000).
                let ok = match id.split_once("::") {
                    Some((fs, ap)) => is_aws_id(fs, "fs-") && is_aws_id(ap, "fsap-"),
                    None => is_aws_id(&id, "fs-"),
                };
                if ok {
                    Ok(Some(StorageBackend::Efs { file_system_id: id }))
                } else {
                    Err(self.invalid(
                        "storage.efs",
                        "expected an EFS id such as fs-0123abcd, or fs-0123abcd::fsap-0123abcd \
                         for an access point"
                            .into(),
                    ))
                }
            }
            (None, Some(fsx)) => {
                let parts: Vec<&str> = fsx.split(',').map(str::trim).collect();
                match parts.as_slice() {
                    [id, dns, mount]
                        if is_aws_id(id, "fs-") && dns.contains('.') && !mount.is_empty() =>
                    {
                        Ok(Some(StorageBackend::Fsx {
                            file_system_id: id.to_string(),
                            dns_name: dns.to_string(),
                            mount_name: mount.to_string(),
                        }))
                    }
                    _ => Err(self.invalid(
                        "storage.fsx",
                        "expected FS_ID,DNS_NAME,MOUNT_NAME, e.g. \
                         fs-0123abcd,fs-0123abcd.fsx.us-west-2.amazonaws.com,abcdefgh"
                            .into(),
                    )),
                }
            }
            (None, None) => Ok(None),
        }
    }
}

pub(super) fn flag_of(key: &str) -> String {
    setting(key).map_or_else(|| key.to_string(), |s| s.flag.to_string())
}

/// A DNS-1123 label of at most `max` characters.
pub fn is_dns_label(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// `1.MINOR`.
pub(super) fn is_kubernetes_version(s: &str) -> bool {
    s.split_once('.')
        .is_some_and(|(a, b)| a == "1" && !b.is_empty() && b.chars().all(|c| c.is_ascii_digit()))
}

pub(super) fn is_region(s: &str) -> bool {
    // us-west-2, eu-central-1, us-gov-west-1, ap-southeast-4 ...
    let parts: Vec<&str> = s.split('-').collect();
    parts.len() >= 3
        && parts[..parts.len() - 1]
            .iter()
            .all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_lowercase()))
        && parts[parts.len() - 1].parse::<u8>().is_ok()
}

pub fn is_aws_id(s: &str, prefix: &str) -> bool {
    s.strip_prefix(prefix)
        .is_some_and(|rest| !rest.is_empty() && rest.chars().all(|c| c.is_ascii_alphanumeric()))
}

/// A Kubernetes quantity: a decimal number with an optional SI or binary suffix.
pub fn is_quantity(s: &str) -> bool {
    const SUFFIXES: [&str; 14] = [
        "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "m", "k", "M", "G", "T", "P", "E", "",
    ];
    SUFFIXES.iter().any(|suffix| {
        s.strip_suffix(suffix).is_some_and(|n| {
            !n.is_empty()
                && n.parse::<f64>().is_ok_and(|x| x > 0.0 && x.is_finite())
                && n.chars().all(|c| c.is_ascii_digit() || c == '.')
        })
    })
}

/// A CPU quantity in millicores: `2`, `250m`, `123456789n`, `1500u`.
pub fn millicores(q: &str) -> Option<u64> {
    let (number, scale) = if let Some(n) = q.strip_suffix('n') {
        (n, 1e-6)
    } else if let Some(n) = q.strip_suffix('u') {
        (n, 1e-3)
    } else if let Some(n) = q.strip_suffix('m') {
        (n, 1.0)
    } else {
        (q, 1000.0)
    };
    let v: f64 = number.parse().ok()?;
    (v.is_finite() && v >= 0.0).then(|| (v * scale).round() as u64)
}

/// A memory quantity in bytes: `1024`, `512Ki`, `2Gi`, `1G`.
pub fn bytes(q: &str) -> Option<u64> {
    const UNITS: [(&str, f64); 10] = [
        ("Ki", 1024.0),
        ("Mi", 1048576.0),
        ("Gi", 1073741824.0),
        ("Ti", 1099511627776.0),
        ("Pi", 1125899906842624.0),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
    ];
    let (number, scale) = UNITS
        .iter()
        .find_map(|(u, s)| q.strip_suffix(u).map(|n| (n, *s)))
        .unwrap_or((q, 1.0));
    let v: f64 = number.parse().ok()?;
    (v.is_finite() && v >= 0.0).then(|| (v * scale).round() as u64)
}
