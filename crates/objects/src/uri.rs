//! `s3://bucket/key` URIs, checked before any request is made.

use std::fmt;
use std::str::FromStr;

use crate::Error;

/// An object (or, for staging, a prefix) in a bucket. The key has no leading slash; an empty key
/// is the bucket's root.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct S3Uri {
    bucket: String,
    key: String,
}

impl S3Uri {
    pub fn new(bucket: &str, key: &str) -> Result<Self, Error> {
        check_bucket(bucket).map_err(|reason| Error::BadUri {
            uri: format!("s3://{bucket}/{key}"),
            reason,
        })?;
        Ok(Self {
            bucket: bucket.to_string(),
            key: key.trim_start_matches('/').to_string(),
        })
    }

    /// True when `text` names S3 (`s3://...`): the callers' cue to go through this crate rather
    /// than the file system.
    pub fn is_s3(text: &str) -> bool {
        text.starts_with("s3://")
    }

    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// The key's last segment (what a download is called locally), if the key names one.
    pub fn file_name(&self) -> Option<&str> {
        self.key.rsplit('/').next().filter(|n| !n.is_empty())
    }

    /// This URI taken as a folder, with `name` under it: `s3://b/runs` + `model.safetensors` is
    /// `s3://b/runs/model.safetensors`.
    pub fn join(&self, name: &str) -> S3Uri {
        let key = match self.key.trim_end_matches('/') {
            "" => name.to_string(),
            prefix => format!("{prefix}/{name}"),
        };
        S3Uri {
            bucket: self.bucket.clone(),
            key,
        }
    }
}

impl fmt::Display for S3Uri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s3://{}/{}", self.bucket, self.key)
    }
}

impl FromStr for S3Uri {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self, Error> {
        let bad = |reason: &str| Error::BadUri {
            uri: text.to_string(),
            reason: reason.to_string(),
        };
        let rest = text
            .strip_prefix("s3://")
            .ok_or_else(|| bad("it does not start with s3:// (write s3://BUCKET/KEY)"))?;
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        if key
            .split('/')
            .any(|segment| segment == "." || segment == "..")
        {
            return Err(bad("its key has a . or .. segment"));
        }
        if key.contains("//") {
            return Err(bad("its key has an empty segment (//)"));
        }
        check_bucket(bucket).map_err(|reason| bad(&reason))?;
        Ok(S3Uri {
            bucket: bucket.to_string(),
            key: key.to_string(),
        })
    }
}

/// S3's rules for bucket names (the ones a typo breaks): 3 to 63 characters, lower-case letters,
/// digits, dots and hyphens, beginning and ending with a letter or digit.
fn check_bucket(bucket: &str) -> Result<(), String> {
    if bucket.is_empty() {
        return Err("it names no bucket (write s3://BUCKET/KEY)".to_string());
    }
    if !(3..=63).contains(&bucket.len()) {
        return Err(format!(
            "bucket name {bucket:?} is {} characters long; S3 allows 3 to 63",
            bucket.len()
        ));
    }
    if let Some(c) = bucket
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '.' || *c == '-'))
    {
        return Err(format!(
            "bucket name {bucket:?} has {c:?}; S3 allows lower-case letters, digits, '.' and '-'"
        ));
    }
    let edge_ok = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if !edge_ok(bucket.chars().next()) || !edge_ok(bucket.chars().last()) {
        return Err(format!(
            "bucket name {bucket:?} must begin and end with a letter or digit"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any text is parsed or refused, never a panic; what parses prints back as itself.
        #[test]
        fn any_text_parses_or_is_refused(text in "(s3://)?[a-z0-9.\\-/_A-Z ]{0,40}") {
            if let Ok(uri) = text.parse::<S3Uri>() {
                let printed = uri.to_string();
                prop_assert_eq!(printed.trim_end_matches('/'), text.trim_end_matches('/'));
                prop_assert_eq!(uri.to_string().parse::<S3Uri>().unwrap(), uri);
            }
        }
    }

    #[test]
    fn parses_bucket_and_key() {
        let uri: S3Uri = "s3://my-bucket/runs/a/model.safetensors".parse().unwrap();
        assert_eq!(uri.bucket(), "my-bucket");
        assert_eq!(uri.key(), "runs/a/model.safetensors");
        assert_eq!(uri.file_name(), Some("model.safetensors"));
        assert_eq!(uri.to_string(), "s3://my-bucket/runs/a/model.safetensors");
        let root: S3Uri = "s3://my-bucket".parse().unwrap();
        assert_eq!(root.key(), "");
        assert_eq!(root.file_name(), None);
        assert_eq!(root.join("x").to_string(), "s3://my-bucket/x");
        let folder: S3Uri = "s3://my-bucket/runs/".parse().unwrap();
        assert_eq!(folder.join("m").key(), "runs/m");
    }

    #[test]
    fn refuses_what_s3_would() {
        for (text, says) in [
            ("my-bucket/key", "does not start with s3://"),
            ("s3:///key", "names no bucket"),
            ("s3://ab/key", "3 to 63"),
            ("s3://My_Bucket/key", "'M'"),
            ("s3://-bucket/key", "begin and end"),
            ("s3://bucket/a/../b", ".. segment"),
            ("s3://bucket/a//b", "empty segment"),
        ] {
            let err = text.parse::<S3Uri>().unwrap_err().to_string();
            assert!(err.contains(text), "{err}");
            assert!(err.contains(says), "{text}: {err}");
        }
    }
}
