//! S3 for trainctl, on the Arrow project's `object_store`: `s3://bucket/key` URIs, uploads
//! (multipart above one part, every request's body checked by S3 against its SHA-256), downloads
//! that land whole or not at all and are checked against the SHA-256 trainctl stores with every
//! upload, and resumable staging of a prefix onto a folder (`stage`).
//!
//! Credentials and the endpoint come from the environment as the AWS SDKs read them
//! (`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`/`AWS_SESSION_TOKEN`, IRSA's
//! `AWS_WEB_IDENTITY_TOKEN_FILE` + `AWS_ROLE_ARN`, EKS pod identity, then the static keys of the
//! AWS CLI's profile (`AWS_PROFILE`, `~/.aws/credentials`), else the instance profile;
//! `AWS_REGION` or the profile's region, `AWS_ENDPOINT_URL` for S3-compatible stores). Throttling (503 SlowDown), server
//! errors and dropped connections are retried with exponential backoff; a download cut off
//! mid-body resumes from where it stopped.
//!
//! The API is blocking: every call runs on the client's own small tokio runtime.

mod error;
#[doc(hidden)]
pub mod fuzzing;
mod profile;
mod stage;
mod uri;

pub use error::Error;
pub use stage::{StageProgress, StageSummary};
pub use uri::S3Uri;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use md5::Md5;
use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path as ObjectPath;
use object_store::{
    Attribute, Attributes, BackoffConfig, ClientOptions, GetOptions, MultipartUpload, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, RetryConfig,
};
use sha2::{Digest, Sha256};

use error::{Action, LocalContext, classify};

/// The user metadata key (`x-amz-meta-sha256`) under which every upload records the SHA-256 of
/// the whole file, checked by every download.
pub(crate) const SHA256_METADATA: &str = "sha256";

/// Where an instance profile's credentials are served when `AWS_METADATA_ENDPOINT` says nothing.
const DEFAULT_METADATA_ENDPOINT: &str = "http://169.254.169.254";

/// How requests are made. The defaults suit S3 from a node or a laptop.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Files larger than this go up in parts of this size (S3's minimum is 5 MiB).
    pub part_size: usize,
    /// Parts in flight for one upload; files in flight while staging.
    pub concurrency: usize,
    /// Retries of one request (throttling, server errors, dropped connections).
    pub max_retries: usize,
    /// No retry starts later than this after a request's first attempt.
    pub retry_timeout: Duration,
    /// The first backoff; each next one doubles, up to 15 s.
    pub initial_backoff: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            part_size: 8 << 20,
            concurrency: 8,
            max_retries: 10,
            retry_timeout: Duration::from_secs(180),
            initial_backoff: Duration::from_millis(100),
        }
    }
}

/// One file moved: its size and how long it took.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Transfer {
    pub bytes: u64,
    pub seconds: f64,
    /// Whether a checksum recorded with the object was checked (downloads only; false for an
    /// object written by another tool without one).
    pub verified: bool,
}

/// A connection to S3 (or an S3-compatible store) as the environment configures it.
pub struct Client {
    runtime: tokio::runtime::Runtime,
    settings: Settings,
    config: AmazonS3Builder,
    stores: Mutex<HashMap<String, Arc<AmazonS3>>>,
    credentials_checked: Mutex<bool>,
    /// Said with `Error::NoCredentials` when the AWS CLI's profile has no static keys.
    profile_note: String,
}

/// Configuration keys that mean the environment itself provides credentials.
const ENVIRONMENT_CREDENTIALS: [AmazonS3ConfigKey; 4] = [
    AmazonS3ConfigKey::AccessKeyId,
    AmazonS3ConfigKey::WebIdentityTokenFile,
    AmazonS3ConfigKey::ContainerCredentialsRelativeUri,
    AmazonS3ConfigKey::ContainerCredentialsFullUri,
];

impl Client {
    /// A client configured from the `AWS_*` environment, and from the AWS CLI's profile for
    /// what the environment does not say.
    pub fn from_env(settings: Settings) -> Result<Self, Error> {
        let mut config = AmazonS3Builder::from_env();
        let profile = profile::from_environment();
        let set = |config: &AmazonS3Builder, keys: &[AmazonS3ConfigKey]| {
            keys.iter().any(|k| config.get_config_value(k).is_some())
        };
        if !set(&config, &ENVIRONMENT_CREDENTIALS)
            && let Some(keys) = &profile.keys
        {
            config = config
                .with_access_key_id(&keys.access_key_id)
                .with_secret_access_key(&keys.secret_access_key);
            if let Some(token) = &keys.session_token {
                config = config.with_token(token);
            }
        }
        if !set(
            &config,
            &[AmazonS3ConfigKey::Region, AmazonS3ConfigKey::DefaultRegion],
        ) && let Some(region) = &profile.region
        {
            config = config.with_region(region);
        }
        let mut client = Self::with_config(config, settings)?;
        client.profile_note = match (&profile.keys, &profile.other_source) {
            (None, Some(source)) => format!(
                " (AWS profile {:?} gets them through {source}, which trainctl does not run)",
                profile.name
            ),
            _ => String::new(),
        };
        Ok(client)
    }

    /// A client from explicit `AWS_*`-style settings (`("aws_endpoint", "...")`), ignoring the
    /// environment: for tests and embedding.
    pub fn with_options<'a>(
        options: impl IntoIterator<Item = (&'a str, &'a str)>,
        settings: Settings,
    ) -> Result<Self, Error> {
        let mut config = AmazonS3Builder::new();
        for (key, value) in options {
            let key: AmazonS3ConfigKey = key.parse().map_err(|e| Error::Store {
                uri: String::new(),
                action: "configure",
                message: format!("{e}"),
            })?;
            config = config.with_config(key, value);
        }
        Self::with_config(config, settings)
    }

    fn with_config(config: AmazonS3Builder, settings: Settings) -> Result<Self, Error> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("s3")
            .enable_all()
            .build()
            .map_err(|source| Error::Local {
                path: PathBuf::from("(tokio runtime)"),
                source,
            })?;
        Ok(Self {
            runtime,
            settings,
            config,
            stores: Mutex::new(HashMap::new()),
            credentials_checked: Mutex::new(false),
            profile_note: String::new(),
        })
    }

    /// Uploads `file` to `to`, in parts when it is larger than one, recording its SHA-256.
    /// A failed multipart upload is aborted, so no orphaned parts stay billed.
    pub fn upload(&self, file: &Path, to: &S3Uri) -> Result<Transfer, Error> {
        let store = self.store(to)?;
        let started = Instant::now();
        let size = std::fs::metadata(file).at(file)?.len();
        let sha256 = hash_file(file)?.sha256;
        let location = object_path(to)?;
        let attributes = Attributes::from_iter([(
            Attribute::Metadata(SHA256_METADATA.into()),
            object_store::AttributeValue::from(sha256),
        )]);
        let part_size = self.settings.part_size.max(5 << 20);
        self.runtime.block_on(async {
            if size <= part_size as u64 {
                let bytes = std::fs::read(file).at(file)?;
                let options = PutOptions {
                    attributes,
                    ..Default::default()
                };
                store
                    .put_opts(&location, PutPayload::from(bytes), options)
                    .await
                    .map_err(|e| classify(e, to, Action::Write))?;
            } else {
                let options = PutMultipartOptions {
                    attributes,
                    ..Default::default()
                };
                let mut upload = store
                    .put_multipart_opts(&location, options)
                    .await
                    .map_err(|e| classify(e, to, Action::Write))?;
                let sent = send_parts(
                    upload.as_mut(),
                    file,
                    to,
                    part_size,
                    self.settings.concurrency,
                )
                .await;
                if let Err(err) = sent {
                    // Best effort: the parts uploaded so far would otherwise be kept (and billed)
                    // until a lifecycle rule removes them.
                    let _ = upload.abort().await;
                    return Err(err);
                }
            }
            Ok(())
        })?;
        Ok(Transfer {
            bytes: size,
            seconds: started.elapsed().as_secs_f64(),
            verified: true,
        })
    }

    /// Downloads `from` to `file`: into a part file beside it, checked (length, and the SHA-256
    /// recorded at upload when there is one), then renamed into place. On any error nothing is
    /// left at `file` or beside it.
    pub fn download(&self, from: &S3Uri, file: &Path) -> Result<Transfer, Error> {
        let store = self.store(from)?;
        self.runtime
            .block_on(download(store.as_ref(), from, file))
            .map(|fetched| fetched.transfer)
    }

    /// Checks what can be checked without a request: that there are credentials to reach `uri`
    /// with. Call it before work whose result is to go to S3.
    pub fn preflight(&self, uri: &S3Uri) -> Result<(), Error> {
        self.check_credentials(uri)
    }

    /// The object store serving `uri`'s bucket (one per bucket: the region is a bucket's).
    fn store(&self, uri: &S3Uri) -> Result<Arc<AmazonS3>, Error> {
        self.check_credentials(uri)?;
        let mut stores = self.stores.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(store) = stores.get(uri.bucket()) {
            return Ok(store.clone());
        }
        let endpoint = self.config.get_config_value(&AmazonS3ConfigKey::Endpoint);
        let mut config = self
            .config
            .clone()
            .with_bucket_name(uri.bucket())
            .with_retry(RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: self.settings.initial_backoff,
                    max_backoff: Duration::from_secs(15),
                    base: 2.0,
                },
                max_retries: self.settings.max_retries,
                retry_timeout: self.settings.retry_timeout,
            })
            .with_checksum_algorithm(object_store::aws::Checksum::SHA256);
        if endpoint
            .as_deref()
            .is_some_and(|e| e.starts_with("http://"))
        {
            config = config.with_allow_http(true);
        }
        let region_set = [AmazonS3ConfigKey::Region, AmazonS3ConfigKey::DefaultRegion]
            .iter()
            .any(|key| self.config.get_config_value(key).is_some());
        if !region_set && endpoint.is_none() {
            // A laptop's region usually lives in ~/.aws/config, which object_store does not
            // read; S3 tells any client where a bucket is.
            let region = self
                .runtime
                .block_on(object_store::aws::resolve_bucket_region(
                    uri.bucket(),
                    &ClientOptions::new(),
                ))
                .map_err(|e| match classify(e, uri, Action::Read) {
                    Error::Store { message, .. } => Error::Region {
                        uri: uri.to_string(),
                        bucket: uri.bucket().to_string(),
                        message,
                    },
                    other => other,
                })?;
            config = config.with_region(region);
        }
        let store = Arc::new(config.build().map_err(|e| Error::Store {
            uri: uri.to_string(),
            action: "configure access to",
            message: format!("{e}"),
        })?);
        stores.insert(uri.bucket().to_string(), store.clone());
        Ok(store)
    }

    /// Without credentials in the environment object_store falls back to the instance profile,
    /// retrying the metadata endpoint for minutes when there is none (a laptop). One short
    /// connection attempt tells at once.
    fn check_credentials(&self, uri: &S3Uri) -> Result<(), Error> {
        let mut checked = self
            .credentials_checked
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if *checked {
            return Ok(());
        }
        let value = |key: AmazonS3ConfigKey| self.config.get_config_value(&key);
        let from_environment = ENVIRONMENT_CREDENTIALS
            .iter()
            .any(|key| self.config.get_config_value(key).is_some())
            || value(AmazonS3ConfigKey::SkipSignature).is_some_and(|v| v == "true");
        if !from_environment {
            let metadata = value(AmazonS3ConfigKey::MetadataEndpoint)
                .unwrap_or_else(|| DEFAULT_METADATA_ENDPOINT.to_string());
            if !answers(&metadata) {
                return Err(Error::NoCredentials {
                    uri: uri.to_string(),
                    metadata,
                    profile: self.profile_note.clone(),
                });
            }
        }
        *checked = true;
        Ok(())
    }
}

/// Whether something accepts a TCP connection at `url`'s host and port within a second (the
/// AWS SDKs give the metadata endpoint one second too).
fn answers(url: &str) -> bool {
    let rest = url
        .split_once("://")
        .map_or(url, |(_, rest)| rest)
        .split('/')
        .next()
        .unwrap_or_default();
    let host_port = if rest
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        rest.to_string()
    } else {
        format!("{rest}:80")
    };
    host_port
        .to_socket_addrs()
        .ok()
        .and_then(|mut addrs| addrs.next())
        .is_some_and(|addr| TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok())
}

pub(crate) fn object_path(uri: &S3Uri) -> Result<ObjectPath, Error> {
    ObjectPath::parse(uri.key()).map_err(|e| Error::BadUri {
        uri: uri.to_string(),
        reason: format!("{e}"),
    })
}

/// Sends `file` in parts of `part_size`, at most `concurrency` in flight, then completes.
async fn send_parts(
    upload: &mut dyn MultipartUpload,
    file: &Path,
    uri: &S3Uri,
    part_size: usize,
    concurrency: usize,
) -> Result<(), Error> {
    let mut reader = std::fs::File::open(file).at(file)?;
    let mut in_flight: FuturesUnordered<object_store::UploadPart> = FuturesUnordered::new();
    loop {
        let mut part = Vec::with_capacity(part_size);
        (&mut reader)
            .take(part_size as u64)
            .read_to_end(&mut part)
            .at(file)?;
        if part.is_empty() {
            break;
        }
        while in_flight.len() >= concurrency.max(1) {
            if let Some(sent) = in_flight.next().await {
                sent.map_err(|e| classify(e, uri, Action::Write))?;
            }
        }
        in_flight.push(upload.put_part(PutPayload::from(part)));
    }
    while let Some(sent) = in_flight.next().await {
        sent.map_err(|e| classify(e, uri, Action::Write))?;
    }
    upload
        .complete()
        .await
        .map_err(|e| classify(e, uri, Action::Write))?;
    Ok(())
}

/// A downloaded object: what it cost, and the MD5 of its bytes (which staging records).
pub(crate) struct Fetched {
    pub transfer: Transfer,
    pub md5: String,
}

/// The part file a download writes before it is renamed to `file`.
pub(crate) fn part_path(file: &Path) -> PathBuf {
    let name = file
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    file.with_file_name(format!(".{name}.trainctl-part"))
}

pub(crate) async fn download(
    store: &dyn ObjectStore,
    from: &S3Uri,
    file: &Path,
) -> Result<Fetched, Error> {
    let started = Instant::now();
    let location = object_path(from)?;
    let got = store
        .get_opts(&location, GetOptions::default())
        .await
        .map_err(|e| classify(e, from, Action::Read))?;
    let expected_size = got.meta.size;
    let expected_sha256 = got
        .attributes
        .get(&Attribute::Metadata(SHA256_METADATA.into()))
        .map(|v| v.as_ref().to_ascii_lowercase());
    let dir = file.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir {
        std::fs::create_dir_all(dir).at(dir)?;
    }
    let part = part_path(file);
    let written = async {
        let mut out = std::fs::File::create(&part).at(&part)?;
        let mut sha256 = Sha256::new();
        let mut md5 = Md5::new();
        let mut bytes = 0u64;
        let mut body = got.into_stream();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| classify(e, from, Action::Read))?;
            sha256.update(&chunk);
            md5.update(&chunk);
            out.write_all(&chunk).at(&part)?;
            bytes += chunk.len() as u64;
        }
        if bytes != expected_size {
            return Err(Error::Truncated {
                uri: from.to_string(),
                got: bytes,
                expected: expected_size,
            });
        }
        let actual = hex(&sha256.finalize());
        if let Some(expected) = expected_sha256.as_ref().filter(|e| **e != actual) {
            return Err(Error::Checksum {
                uri: from.to_string(),
                algorithm: "SHA-256",
                expected: expected.clone(),
                actual,
            });
        }
        out.sync_all().at(&part)?;
        std::fs::rename(&part, file).at(file)?;
        if let Some(dir) = dir {
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .at(dir)?;
        }
        Ok(hex(&md5.finalize()))
    }
    .await;
    match written {
        Ok(md5) => Ok(Fetched {
            transfer: Transfer {
                bytes: expected_size,
                seconds: started.elapsed().as_secs_f64(),
                verified: expected_sha256.is_some(),
            },
            md5,
        }),
        Err(err) => {
            let _ = std::fs::remove_file(&part);
            Err(err)
        }
    }
}

/// A local file's digests.
pub(crate) struct Digests {
    pub sha256: String,
    pub md5: String,
}

pub(crate) fn hash_file(file: &Path) -> Result<Digests, Error> {
    let mut reader = std::fs::File::open(file).at(file)?;
    let mut sha256 = Sha256::new();
    let mut md5 = Md5::new();
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let n = reader.read(&mut buffer).at(file)?;
        if n == 0 {
            break;
        }
        sha256.update(&buffer[..n]);
        md5.update(&buffer[..n]);
    }
    Ok(Digests {
        sha256: hex(&sha256.finalize()),
        md5: hex(&md5.finalize()),
    })
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_files_are_hidden_beside_the_file() {
        assert_eq!(
            part_path(Path::new("/d/model.safetensors")),
            Path::new("/d/.model.safetensors.trainctl-part")
        );
    }

    #[test]
    fn a_closed_port_does_not_answer() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let open = format!("http://{}", listener.local_addr().unwrap());
        assert!(answers(&open));
        drop(listener);
        assert!(!answers(&open));
    }

    #[test]
    fn no_credentials_is_said_before_any_request() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let closed = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        let client = Client::with_options(
            [
                ("aws_metadata_endpoint", closed.as_str()),
                ("aws_region", "eu-west-1"),
            ],
            Settings::default(),
        )
        .unwrap();
        let uri: S3Uri = "s3://some-bucket/model.safetensors".parse().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let err = client
            .download(&uri, &dir.path().join("m"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no AWS credentials to reach s3://some-bucket/model.safetensors"),
            "{err}"
        );
        assert!(err.contains(&closed), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
