//! A setting's value read into its field's type: [`FromSetting`], which a row of
//! [`super::SETTINGS`] that names its field (`-> job.epochs`) uses to write it, or the reader
//! the row names (`by ...`) where the field's type alone does not say how.

use contract::choices::{Choice, HealthCheck, Model, Precision, Stragglers};

use crate::catalog::{self, InstanceType, Preset};

use super::values::Values;
use super::{ConfigError, EtcdStorage, Launcher, MpiImplementation, RdzvBackend, split_words};

/// A type a setting's value is read into, naming the setting and its source on error. The
/// value has passed its row's [`super::Parse`] check already.
pub(super) trait FromSetting: Sized {
    fn read(v: &Values, key: &'static str) -> Result<Self, ConfigError>;
}

impl FromSetting for String {
    fn read(v: &Values, key: &'static str) -> Result<Self, ConfigError> {
        v.str(key)
    }
}

macro_rules! numbers {
    ($($t:ty),*) => {$(
        impl FromSetting for $t {
            fn read(v: &Values, key: &'static str) -> Result<Self, ConfigError> {
                v.number(key)
            }
        }
    )*};
}
numbers!(u16, u32, i32, f64);

/// No value, or `none`: `None`.
impl<T: FromSetting> FromSetting for Option<T> {
    fn read(v: &Values, key: &'static str) -> Result<Self, ConfigError> {
        match v.optional(key).as_deref() {
            None | Some("none") => Ok(None),
            Some(_) => T::read(v, key).map(Some),
        }
    }
}

/// A comma-separated list.
impl FromSetting for Vec<String> {
    fn read(v: &Values, key: &'static str) -> Result<Self, ConfigError> {
        Ok(v.list(key))
    }
}

/// A setting with a few named values ([`Choice`]), refused with its choices.
macro_rules! choices {
    ($($t:ty),*) => {$(
        impl FromSetting for $t {
            fn read(v: &Values, key: &'static str) -> Result<Self, ConfigError> {
                <$t as Choice>::parse(&v.str(key)?)
                    .ok_or_else(|| v.invalid(key, format!("choose {}", <$t as Choice>::choices())))
            }
        }
    )*};
}
choices!(Model, Precision, Stragglers, HealthCheck);

/// A data set by its name (`cifar10`), as the trainer's `--dataset` takes it.
impl FromSetting for contract::Dataset {
    fn read(v: &Values, key: &'static str) -> Result<Self, ConfigError> {
        let name = v.str(key)?;
        contract::DATASETS
            .into_iter()
            .find(|d| d.name == name)
            .ok_or_else(|| v.invalid(key, format!("choose {}", contract::DATASET_CHOICES)))
    }
}

impl FromSetting for &'static InstanceType {
    fn read(v: &Values, key: &'static str) -> Result<Self, ConfigError> {
        v.instance(key)
    }
}

impl FromSetting for Preset {
    fn read(v: &Values, key: &'static str) -> Result<Self, ConfigError> {
        Preset::parse(&v.str(key)?).ok_or_else(|| {
            v.invalid(
                key,
                format!(
                    "unknown preset; choose one of {}",
                    Preset::ALL.map(Preset::name).join(", ")
                ),
            )
        })
    }
}

impl FromSetting for Launcher {
    fn read(v: &Values, key: &'static str) -> Result<Self, ConfigError> {
        Launcher::parse(&v.str(key)?)
            .ok_or_else(|| v.invalid(key, format!("choose {}", Launcher::choices())))
    }
}

impl FromSetting for RdzvBackend {
    fn read(v: &Values, key: &'static str) -> Result<Self, ConfigError> {
        match v.str(key)?.parse() {
            Ok(contract::rdzv::Backend::C10d) => Ok(RdzvBackend::C10d),
            Ok(contract::rdzv::Backend::Etcd) => Ok(RdzvBackend::Etcd),
            _ => Err(v.invalid(
                key,
                "choose c10d (the store in pod 0) or etcd (an etcd next to the job)".into(),
            )),
        }
    }
}

impl FromSetting for EtcdStorage {
    fn read(v: &Values, key: &'static str) -> Result<Self, ConfigError> {
        match v.str(key)?.as_str() {
            "emptydir" => Ok(EtcdStorage::EmptyDir),
            "claim" => Ok(EtcdStorage::Claim),
            _ => Err(v.invalid(
                key,
                "choose emptydir (the data lives with the etcd pod) or claim (a folder on the \
                 shared claim)"
                    .into(),
            )),
        }
    }
}

impl FromSetting for MpiImplementation {
    fn read(v: &Values, key: &'static str) -> Result<Self, ConfigError> {
        MpiImplementation::parse(&v.str(key)?).ok_or_else(|| {
            v.invalid(
                key,
                "choose openmpi, intel or mpich (what the image's mpirun is)".into(),
            )
        })
    }
}

/// The program and its arguments, as shell words; none: the built-in trainer.
pub(super) fn command(v: &Values, key: &'static str) -> Result<Option<Vec<String>>, ConfigError> {
    let Some(text) = v.optional(key).filter(|t| t != "none") else {
        return Ok(None);
    };
    match split_words(&text) {
        Some(words) if !words.is_empty() => Ok(Some(words)),
        Some(_) => Ok(None),
        None => Err(v.invalid(
            key,
            "not shell words: a quote is not closed or the text ends in a backslash; write it \
             as a list in trainctl.toml (command = [\"python\", \"main.py\"]) or after -- on the \
             command line"
                .into(),
        )),
    }
}

/// `KEY=VALUE`, a node label; none: no selector.
pub(super) fn node_selector(
    v: &Values,
    key: &'static str,
) -> Result<Option<(String, String)>, ConfigError> {
    let Some(text) = v.optional(key).filter(|t| t != "none") else {
        return Ok(None);
    };
    match text.split_once('=') {
        Some((k, val)) if !k.trim().is_empty() => {
            Ok(Some((k.trim().to_string(), val.trim().to_string())))
        }
        _ => Err(v.invalid(key, "expected KEY=VALUE (a node label), or none".into())),
    }
}

/// A port, or 0 for none.
pub(super) fn port_or_off(v: &Values, key: &'static str) -> Result<Option<u16>, ConfigError> {
    Ok(Some(v.number::<u16>(key)?).filter(|&p| p != 0))
}

/// S3 URIs, space-separated.
pub(super) fn s3_uris(v: &Values, key: &'static str) -> Result<Vec<String>, ConfigError> {
    v.optional(key)
        .unwrap_or_default()
        .split_whitespace()
        .map(|uri| v.s3_uri(key, uri))
        .collect()
}

/// A bucket's name, checked as the bucket of an S3 URI.
pub(super) fn s3_bucket(v: &Values, key: &'static str) -> Result<Option<String>, ConfigError> {
    match v.optional(key).filter(|b| b != "none") {
        Some(bucket) => v
            .s3_uri(key, &format!("s3://{bucket}/"))
            .map(|_| Some(bucket)),
        None => Ok(None),
    }
}

impl Default for &'static InstanceType {
    fn default() -> Self {
        &catalog::INSTANCE_TYPES[0]
    }
}
