//! The AWS CLI's files on a laptop: `~/.aws/credentials` (static keys of a profile) and
//! `~/.aws/config` (its region), read when the environment has neither. object_store reads
//! only the environment; the AWS SDKs read these files too, and users expect the same.

use std::path::{Path, PathBuf};

/// A profile's static keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Keys {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

/// What the files say for one profile.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Profile {
    pub name: String,
    pub keys: Option<Keys>,
    pub region: Option<String>,
    /// The config file gives this profile another way to get credentials (SSO, an assumed
    /// role, a process) that trainctl does not run.
    pub other_source: Option<String>,
}

/// Where the files are and which profile, as the AWS CLI decides: `AWS_PROFILE` (else
/// `default`), `AWS_SHARED_CREDENTIALS_FILE` and `AWS_CONFIG_FILE` (else under `~/.aws`).
/// These are the AWS CLI's own variables; object_store reads the other `AWS_*` ones.
#[allow(clippy::disallowed_methods)]
pub(crate) fn from_environment() -> Profile {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let home = var("HOME").map(PathBuf::from);
    let file = |variable: &str, name: &str| {
        var(variable)
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(".aws").join(name)))
    };
    let name = var("AWS_PROFILE").unwrap_or_else(|| "default".to_string());
    read(
        &name,
        file("AWS_SHARED_CREDENTIALS_FILE", "credentials").as_deref(),
        file("AWS_CONFIG_FILE", "config").as_deref(),
    )
}

fn read(name: &str, credentials: Option<&Path>, config: Option<&Path>) -> Profile {
    let text = |path: Option<&Path>| path.and_then(|p| std::fs::read_to_string(p).ok());
    let credentials = text(credentials).unwrap_or_default();
    let config = text(config).unwrap_or_default();
    // The credentials file names sections `[NAME]`; the config file `[profile NAME]`, except
    // `[default]`.
    let config_section = if name == "default" {
        "default".to_string()
    } else {
        format!("profile {name}")
    };
    let keys_in = |text: &str, section: &str| {
        let access_key_id = value(text, section, "aws_access_key_id")?;
        let secret_access_key = value(text, section, "aws_secret_access_key")?;
        Some(Keys {
            access_key_id,
            secret_access_key,
            session_token: value(text, section, "aws_session_token"),
        })
    };
    let other_source = [
        "sso_session",
        "sso_start_url",
        "role_arn",
        "credential_process",
    ]
    .into_iter()
    .find(|key| value(&config, &config_section, key).is_some())
    .map(str::to_string);
    Profile {
        name: name.to_string(),
        keys: keys_in(&credentials, name).or_else(|| keys_in(&config, &config_section)),
        region: value(&config, &config_section, "region"),
        other_source,
    }
}

/// `key` in `[section]` of an INI text (`key = value`, `#` and `;` comments).
fn value(text: &str, section: &str, key: &str) -> Option<String> {
    let mut inside = false;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = name.trim() == section;
            continue;
        }
        if inside
            && let Some((k, v)) = line.split_once('=')
            && k.trim() == key
        {
            return Some(v.trim().to_string()).filter(|v| !v.is_empty());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const CREDENTIALS: &str = "\
[default]
aws_access_key_id = AKIADEFAULT
aws_secret_access_key = secret/default

# a comment
[work]
aws_access_key_id=AKIAWORK
aws_secret_access_key=secret-work
aws_session_token = token
";

    const CONFIG: &str = "\
[default]
region = eu-west-1
[profile work]
region = us-east-2
[profile sso]
sso_session = company
region = ap-south-1
";

    fn profile(name: &str) -> Profile {
        let dir = tempfile::tempdir().unwrap();
        let credentials = dir.path().join("credentials");
        let config = dir.path().join("config");
        std::fs::write(&credentials, CREDENTIALS).unwrap();
        std::fs::write(&config, CONFIG).unwrap();
        read(name, Some(&credentials), Some(&config))
    }

    #[test]
    fn a_profiles_keys_and_region_come_from_its_sections() {
        let default = profile("default");
        assert_eq!(default.keys.unwrap().secret_access_key, "secret/default");
        assert_eq!(default.region.as_deref(), Some("eu-west-1"));
        let work = profile("work");
        assert_eq!(
            work.keys,
            Some(Keys {
                access_key_id: "AKIAWORK".into(),
                secret_access_key: "secret-work".into(),
                session_token: Some("token".into()),
            })
        );
        assert_eq!(work.region.as_deref(), Some("us-east-2"));
    }

    #[test]
    fn a_profile_without_keys_says_how_it_gets_them() {
        let sso = profile("sso");
        assert_eq!(sso.keys, None);
        assert_eq!(sso.other_source.as_deref(), Some("sso_session"));
        assert_eq!(
            profile("nobody"),
            Profile {
                name: "nobody".into(),
                ..Profile::default()
            }
        );
        assert_eq!(read("default", None, None).keys, None);
    }
}
