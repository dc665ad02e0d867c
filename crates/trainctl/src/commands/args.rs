//! The flags and parsers several commands share: a setting with a few names ([`choice`]:
//! `--model`, `--precision`, `--stragglers`, `--health-check`), `--dataset`, and where a
//! missing data set is downloaded from ([`Mirror`]).

use std::ffi::OsStr;
use std::marker::PhantomData;

use anyhow::bail;
use clap::builder::{PossibleValue, TypedValueParser};
use clap::error::ErrorKind;
use contract::choices::Choice;
use trainer::data::{DEFAULT_STALL_TIMEOUT, DatasetName, DownloadOptions};

/// The value parser of a flag that takes one of `T`'s names: `--help` lists them, and a wrong
/// one is refused (exit 2) with the choices.
pub(crate) fn choice<T: Choice + Send + Sync>() -> ChoiceParser<T> {
    ChoiceParser(PhantomData)
}

#[derive(Clone)]
pub(crate) struct ChoiceParser<T>(PhantomData<T>);

impl<T: Choice + Send + Sync> TypedValueParser for ChoiceParser<T> {
    type Value = T;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<T, clap::Error> {
        let text = value.to_string_lossy();
        T::parse(&text).ok_or_else(|| {
            let flag = arg.map_or_else(String::new, |a| format!(" for '{a}'"));
            clap::Error::raw(
                ErrorKind::InvalidValue,
                format!("invalid value '{text}'{flag}: choose {}\n", T::choices()),
            )
            .with_cmd(cmd)
        })
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = PossibleValue> + '_>> {
        Some(Box::new(T::ALL.iter().map(|c| {
            PossibleValue::new(c.name()).aliases(c.aliases().iter().copied())
        })))
    }
}

pub(crate) fn parse_dataset(name: &str) -> anyhow::Result<DatasetName> {
    match DatasetName::parse(name) {
        Some(d) => Ok(d),
        None => bail!("--dataset {name:?}: choose {}", DatasetName::CHOICES),
    }
}

/// Where a missing data set is downloaded from: the flags `train`, `eval` and `data fetch`
/// share.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct Mirror {
    /// Download from here instead of the official address of --dataset.
    #[arg(long)]
    pub(crate) download_url: Option<String>,
    /// Expected MD5 of the downloaded archive (default: the official archive's).
    #[arg(long)]
    download_md5: Option<String>,
    /// Seconds without a byte from the download's server before a try is given up; the
    /// download is retried with backoff, resuming, and fails after 4 tries in a row that bring
    /// nothing.
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_STALL_TIMEOUT.as_secs_f64())]
    pub(crate) download_stall_timeout: f64,
}

impl Mirror {
    /// The official archive of `dataset`, or the mirror and checksum given (a mirror's size is
    /// not known; its MD5 still is checked). `turn_on` says how this command enables
    /// downloads (`DownloadOptions::turn_on`), for the hint when `enabled` is false.
    pub(crate) fn options(
        self,
        dataset: DatasetName,
        enabled: bool,
        turn_on: Option<&'static str>,
    ) -> anyhow::Result<DownloadOptions> {
        let seconds = self.download_stall_timeout;
        if !(seconds.is_finite() && seconds > 0.0) {
            bail!(
                "--download-stall-timeout must be a positive number of seconds, got {seconds}; leave it out for {} s",
                DEFAULT_STALL_TIMEOUT.as_secs()
            );
        }
        let official = dataset.official();
        let (url, md5) = (self.download_url, self.download_md5);
        Ok(DownloadOptions {
            enabled,
            size: official.size.filter(|_| md5.is_none() && url.is_none()),
            url: url.unwrap_or(official.url),
            md5: md5.unwrap_or(official.md5),
            stall_timeout: std::time::Duration::from_secs_f64(seconds),
            turn_on,
        })
    }
}
