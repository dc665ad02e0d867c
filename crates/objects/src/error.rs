//! What can go wrong talking to S3, each case saying which URI and what to do next.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{uri:?} is not an S3 URI: {reason}")]
    BadUri { uri: String, reason: String },

    #[error(
        "no AWS credentials to reach {uri}: none in the environment (AWS_ACCESS_KEY_ID and \
         AWS_SECRET_ACCESS_KEY, an IRSA web identity, EKS pod identity) or in the AWS CLI's \
         profile{profile}, and no instance profile answers at {metadata}; export some (with \
         the AWS CLI: eval \"$(aws configure export-credentials --format env)\"), or on EKS \
         run the pods under the S3 service account (cluster config --s3-bucket)"
    )]
    NoCredentials {
        uri: String,
        metadata: String,
        profile: String,
    },

    #[error(
        "S3 refused the credentials while reaching {uri} ({code}): check AWS_ACCESS_KEY_ID and \
         AWS_SECRET_ACCESS_KEY (or AWS_SESSION_TOKEN, which expires); `aws sts \
         get-caller-identity` shows who they are"
    )]
    BadCredentials { uri: String, code: String },

    #[error(
        "access denied: the credentials in use may not {action} {uri}; grant them s3 access to \
         bucket {bucket:?} (on EKS, `trainctl cluster config --s3-bucket {bucket}` gives the \
         pods' service account exactly that)"
    )]
    AccessDenied {
        uri: String,
        bucket: String,
        action: &'static str,
    },

    #[error(
        "bucket {bucket:?} does not exist (reaching {uri}): check the name, or create it with \
         `aws s3 mb s3://{bucket}`"
    )]
    NoSuchBucket { uri: String, bucket: String },

    #[error("{uri} does not exist: check the key (`aws s3 ls {parent}` lists what is there)")]
    NoSuchKey { uri: String, parent: String },

    #[error(
        "nothing at {uri}: no object has that key and none is under it as a folder; check the \
         key (`aws s3 ls {parent}` lists what is there)"
    )]
    EmptyPrefix { uri: String, parent: String },

    #[error(
        "{uri}: the downloaded bytes do not match the object's checksum ({algorithm} {expected}, \
         got {actual}); nothing was kept: run the command again"
    )]
    Checksum {
        uri: String,
        algorithm: &'static str,
        expected: String,
        actual: String,
    },

    #[error(
        "{uri}: the connection ended after {got} of the object's {expected} bytes; nothing was \
         kept: run the command again"
    )]
    Truncated {
        uri: String,
        got: u64,
        expected: u64,
    },

    #[error(
        "cannot find which region bucket {bucket:?} is in (reaching {uri}): {message}; set \
         AWS_REGION to its region (or AWS_ENDPOINT_URL for an S3-compatible store)"
    )]
    Region {
        uri: String,
        bucket: String,
        message: String,
    },

    #[error("{uri}: the key cannot be a local path under the destination: {reason}")]
    UnsafeKey { uri: String, reason: String },

    #[error("{path}: {source}")]
    Local {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("could not {action} {uri}: {message}; check the network and AWS_ENDPOINT_URL (if set)")]
    Store {
        uri: String,
        action: &'static str,
        message: String,
    },
}

/// Attaches the local path to an I/O error.
pub(crate) trait LocalContext<T> {
    fn at(self, path: &std::path::Path) -> Result<T, Error>;
}

impl<T> LocalContext<T> for std::io::Result<T> {
    fn at(self, path: &std::path::Path) -> Result<T, Error> {
        self.map_err(|source| Error::Local {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// What the caller was doing, for the messages.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Action {
    Read,
    Write,
    List,
}

impl Action {
    fn verb(self) -> &'static str {
        match self {
            Action::Read => "read",
            Action::Write => "write",
            Action::List => "list",
        }
    }
}

/// Turns object_store's error into one of ours. S3 says what went wrong in its XML error code,
/// which object_store keeps in the message; the HTTP status alone cannot tell a missing bucket
/// from a missing key, or wrong credentials from a policy that denies.
pub(crate) fn classify(err: object_store::Error, uri: &crate::S3Uri, action: Action) -> Error {
    let message = format!("{err}");
    let has = |code: &str| message.contains(code);
    let uri_text = uri.to_string();
    if has("NoSuchBucket") {
        return Error::NoSuchBucket {
            uri: uri_text,
            bucket: uri.bucket().to_string(),
        };
    }
    for code in [
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
    ] {
        if has(code) {
            return Error::BadCredentials {
                uri: uri_text,
                code: code.to_string(),
            };
        }
    }
    match err {
        object_store::Error::NotFound { .. } => Error::NoSuchKey {
            parent: parent_of(uri),
            uri: uri_text,
        },
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => Error::AccessDenied {
            uri: uri_text,
            bucket: uri.bucket().to_string(),
            action: action.verb(),
        },
        _ => Error::Store {
            uri: uri_text,
            action: action.verb(),
            message,
        },
    }
}

pub(crate) fn parent_of(uri: &crate::S3Uri) -> String {
    match uri.key().rsplit_once('/') {
        Some((parent, _)) => format!("s3://{}/{parent}/", uri.bucket()),
        None => format!("s3://{}/", uri.bucket()),
    }
}
