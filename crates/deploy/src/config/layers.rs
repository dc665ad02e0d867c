//! The layers (flags, `TRAINCTL_*` variables, `trainctl.toml`, preset, defaults) and their
//! resolution into one value per setting, each with its [`Source`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::catalog::{self, INSTANCE_TYPE_LABEL, InstanceType, Preset};

use super::{ConfigError, DEFAULT_IMAGE, S3_SERVICE_ACCOUNT, SETTINGS, Source, setting};

/// The values as given, layer by layer.
pub struct Layers<'a> {
    /// `(key, value)` from the command line.
    pub flags: Vec<(&'static str, String)>,
    /// Looks a variable up (the process environment, or a map in tests).
    pub env: &'a dyn Fn(&str) -> Option<String>,
    /// The project file's path and text, if there is one.
    pub file: Option<(PathBuf, String)>,
}

impl Layers<'_> {
    /// Reads `path` if given (it must exist), else `./trainctl.toml` when present.
    pub fn read_file(path: Option<&Path>) -> Result<Option<(PathBuf, String)>, ConfigError> {
        let (path, required) = match path {
            Some(p) => (p.to_path_buf(), true),
            None => (PathBuf::from("trainctl.toml"), false),
        };
        match std::fs::read_to_string(&path) {
            Ok(text) => Ok(Some((path, text))),
            Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(ConfigError::Read {
                file: path.display().to_string(),
                error,
            }),
        }
    }
}

/// The effective value of every setting that has one, and where it came from.
#[derive(Debug, Clone, Default)]
pub struct Resolved {
    pub values: BTreeMap<&'static str, (String, Source)>,
}

impl Resolved {
    pub fn get(&self, key: &str) -> Option<&str> {
        self.values.get(key).map(|(v, _)| v.as_str())
    }

    /// Layers the values, then fills in what the preset and the defaults give.
    pub fn resolve(layers: &Layers) -> Result<Resolved, ConfigError> {
        let file_values = match &layers.file {
            Some((path, text)) => parse_file(path, text)?,
            None => BTreeMap::new(),
        };
        let mut values = BTreeMap::new();
        for s in SETTINGS {
            let flag = layers.flags.iter().rev().find(|(k, _)| *k == s.key);
            let value = if let Some((_, v)) = flag {
                Some((v.clone(), Source::Flag(s.flag)))
            } else if let Some(v) = (layers.env)(&s.env_var()).filter(|v| !v.is_empty()) {
                Some((v, Source::Env(s.env_var())))
            } else {
                file_values.get(s.key).map(|v| {
                    let path = layers.file.as_ref().map(|(p, _)| p.clone());
                    (v.clone(), Source::File(path.unwrap_or_default()))
                })
            };
            if let Some(v) = value {
                values.insert(s.key, v);
            }
        }
        let mut resolved = Resolved { values };
        resolved.fill_defaults();
        Ok(resolved)
    }

    /// The settings' defaults and the preset's, then the settings derived from the others,
    /// where no layer gave them.
    pub(super) fn fill_defaults(&mut self) {
        let preset = self
            .get("cluster.preset")
            .and_then(Preset::parse)
            .unwrap_or(Preset::Cpu);
        let mut default = |key: &'static str, value: String, source: Source| {
            self.values.entry(key).or_insert((value, source));
        };
        for s in SETTINGS {
            if let Some(value) = s.default {
                default(s.key, value.into(), Source::Default);
            }
        }
        default(
            "cluster.instance_type",
            preset.instance_type().into(),
            Source::Preset(preset.name()),
        );
        default("cluster.nodes", "2".into(), Source::Preset(preset.name()));
        self.derive();
    }

    /// The settings computed from others (`Source::Derived`), where none was given.
    fn derive(&mut self) {
        let mount = self
            .get("storage.mount_path")
            .unwrap_or("/data")
            .to_string();
        let mount = mount.trim_end_matches('/');
        let nodes = self.get("cluster.nodes").unwrap_or("2").to_string();
        let region = self
            .get("cluster.region")
            .unwrap_or("us-west-2")
            .to_string();
        let pick_zones = self.get("cluster.existing_vpc").is_none()
            && self.get("cluster.capacity_reservation_id").is_none();
        let instance = self
            .get("cluster.instance_type")
            .and_then(catalog::instance_type);
        let image = self.get("image").unwrap_or(DEFAULT_IMAGE).to_string();
        let dataset = self
            .get("data.dataset")
            .unwrap_or(contract::CIFAR10.name)
            .to_string();
        let bucket = self.get("cluster.s3_bucket").map(str::to_string);
        let job_name = self.get("job.name").unwrap_or("cifar10").to_string();
        // An unknown name is refused when the settings are checked; its derived values
        // do not matter.
        let official = contract::Dataset::parse(&dataset).unwrap_or(contract::CIFAR10);
        let (url, md5) = (official.url, official.md5);
        let mut derived = |key: &'static str, value: String, from: &'static str| {
            self.values
                .entry(key)
                .or_insert((value, Source::Derived(from)));
        };
        derived("trainctl_image", image, "image");
        derived("data.url", url.into(), "data.dataset");
        derived("data.md5", md5.into(), "data.dataset");
        derived(
            "data.dir",
            format!("{mount}/{dataset}"),
            "storage.mount_path",
        );
        derived(
            "job.runs_dir",
            format!("{mount}/runs"),
            "storage.mount_path",
        );
        derived("job.nnodes", nodes, "cluster.nodes");
        if let Some(bucket) = bucket {
            derived(
                "service_account",
                S3_SERVICE_ACCOUNT.into(),
                "cluster.s3_bucket",
            );
            derived(
                "job.upload",
                format!("s3://{bucket}/runs/{job_name}"),
                "cluster.s3_bucket",
            );
        }
        // A new VPC without a reservation can go anywhere in the region: its first zones. An
        // existing VPC's zones are its subnets', and a reservation's is its own: those are asked.
        if pick_zones {
            derived(
                "cluster.availability_zones",
                catalog::default_zones(&region).join(","),
                "cluster.region",
            );
        }
        if let Some(t) = instance {
            derived(
                "job.node_selector",
                format!("{INSTANCE_TYPE_LABEL}={}", t.name),
                "cluster.instance_type",
            );
            let (cpu, memory, shm) = pod_size(t);
            derived(
                "job.gpus_per_node",
                t.gpus.to_string(),
                "cluster.instance_type",
            );
            derived("job.cpu", cpu, "cluster.instance_type");
            derived("job.memory", memory, "cluster.instance_type");
            derived("job.shm_size", shm, "cluster.instance_type");
        }
    }
}

/// Requests that fit one pod per node: the node's allocatable share after the kubelet,
/// the system daemons and the DaemonSets (about 15 % of CPU, 20 % of memory).
pub(super) fn pod_size(t: &InstanceType) -> (String, String, String) {
    let cpu = (t.vcpus * 85 / 100).max(1);
    let memory = (t.memory_gib * 80 / 100).max(1);
    let shm = if t.gpus > 0 {
        (memory / 4).clamp(1, 64)
    } else {
        (memory / 8).clamp(1, 8)
    };
    (cpu.to_string(), format!("{memory}Gi"), format!("{shm}Gi"))
}

/// Flattens `[section] key = value` into `section.key`, refusing keys no setting has.
pub(super) fn parse_file(path: &Path, text: &str) -> Result<BTreeMap<String, String>, ConfigError> {
    let file = path.display().to_string();
    let table: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Parse {
        file: file.clone(),
        message: e.to_string().trim_end().to_string(),
    })?;
    let mut out = BTreeMap::new();
    let unknown = |key: String| ConfigError::UnknownKey {
        file: file.clone(),
        key,
        known: SETTINGS
            .iter()
            .map(|s| s.key)
            .collect::<Vec<_>>()
            .join(", "),
    };
    for (name, value) in table {
        match value {
            toml::Value::Table(section) => {
                for (k, v) in section {
                    let key = format!("{name}.{k}");
                    if setting(&key).is_none() {
                        return Err(unknown(key));
                    }
                    let value = if key == "job.command" {
                        command_words(&file, &key, v)?
                    } else {
                        scalar(&file, &key, v)?
                    };
                    out.insert(key, value);
                }
            }
            v => {
                if setting(&name).is_none() {
                    return Err(unknown(name));
                }
                let value = scalar(&file, &name, v)?;
                out.insert(name, value);
            }
        }
    }
    Ok(out)
}

/// A command in the file: a list of words (`["python", "main.py"]`), kept as one string of
/// shell words so that it layers like every other setting; or a string of shell words as is.
pub(super) fn command_words(file: &str, key: &str, v: toml::Value) -> Result<String, ConfigError> {
    let toml::Value::Array(items) = v else {
        return scalar(file, key, v);
    };
    let words = items
        .into_iter()
        .map(|i| match i {
            toml::Value::String(s) => Ok(s),
            other => Err(ConfigError::Parse {
                file: file.to_string(),
                message: format!("{key}: expected a list of strings, got {other}"),
            }),
        })
        .collect::<Result<Vec<_>, _>>()?;
    join_words(&words).map_err(|message| ConfigError::Parse {
        file: file.to_string(),
        message: format!("{key}: {message}"),
    })
}

/// Words as one string that [`split_words`] gives back exactly (POSIX shell quoting).
pub fn join_words<S: AsRef<str>>(words: &[S]) -> Result<String, String> {
    shlex::try_join(words.iter().map(AsRef::as_ref))
        .map_err(|_| "a word holds a NUL byte, which no program argument can".into())
}

/// A string of shell words as the words (quotes and backslashes as a POSIX shell reads them;
/// no expansion).
pub fn split_words(s: &str) -> Option<Vec<String>> {
    shlex::split(s)
}

pub(super) fn scalar(file: &str, key: &str, v: toml::Value) -> Result<String, ConfigError> {
    Ok(match v {
        toml::Value::String(s) => s,
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        toml::Value::Array(items) => items
            .into_iter()
            .map(|i| scalar(file, key, i))
            .collect::<Result<Vec<_>, _>>()?
            .join(","),
        other => {
            return Err(ConfigError::Parse {
                file: file.to_string(),
                message: format!("{key}: expected a string, number or list, got {other}"),
            });
        }
    })
}
