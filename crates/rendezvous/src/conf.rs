//! `--rdzv-conf key=value,...`: the rendezvous timings, torchrun's names where it has them.

use std::time::Duration;

use crate::state::Limits;

/// How a rendezvous behaves. Defaults favour a fast recovery on a healthy network.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub run_id: String,
    pub limits: Limits,
    /// Longest wait for a round to complete (torchrun: 600 s).
    pub join_timeout: Duration,
    /// Once MIN nodes have joined, how long to wait for more (torchrun: 30 s). A round that
    /// restarts after a failure or admits a waiting node completes as soon as every live node
    /// it expects has joined, without this wait.
    pub last_call_timeout: Duration,
    /// Longest an agent tries to mark the job finished or failed in the store.
    pub close_timeout: Duration,
    /// The exit barrier: how long a node whose workers finished waits for the others' to
    /// (torchrun: exit_barrier_timeout, 300 s), so that its exit says the job is done.
    pub exit_barrier_timeout: Duration,
    /// Time between two heartbeats of an agent.
    pub heartbeat: Duration,
    /// An agent silent this long is gone (torchrun: 5 s × 3 attempts). A killed agent's store
    /// connection closes, which the c10d store notices at once; a cut link takes this long.
    pub heartbeat_timeout: Duration,
    /// How long one call to the store may take.
    pub store_timeout: Duration,
    /// Time between two reads of the rendezvous record while joining or watching (a backend
    /// that watches the store wakes sooner, on a change).
    pub poll: Duration,
    /// Nodes that arrive while a round runs are gathered this long, then admitted together by
    /// one new round (at once when they fill the job); each admission in a row doubles how
    /// long the next round runs first, up to 30 s ([`crate::state::admission_cooldown`]).
    pub join_window: Duration,
    /// The job's token: every connection to a c10d store proves it (etcd's own access
    /// control applies there).
    pub token: String,
    /// Under c10d, `Some(true)`: this agent must host the store; `Some(false)`: never; `None`:
    /// the agent whose host is the endpoint does (`--rdzv-conf is_host=...`).
    pub is_host: Option<bool>,
}

impl Config {
    pub fn new(run_id: &str, limits: Limits) -> Self {
        Config {
            run_id: run_id.to_string(),
            limits,
            join_timeout: Duration::from_secs(600),
            last_call_timeout: Duration::from_secs(1),
            close_timeout: Duration::from_secs(10),
            exit_barrier_timeout: Duration::from_secs(300),
            heartbeat: Duration::from_millis(500),
            heartbeat_timeout: Duration::from_secs(2),
            store_timeout: Duration::from_secs(3),
            poll: Duration::from_millis(50),
            join_window: Duration::from_secs(2),
            token: String::new(),
            is_host: None,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfError {
    #[error("--rdzv-conf: {0:?} is not key=value")]
    NotKeyValue(String),
    #[error(
        "--rdzv-conf: unknown key {0:?} (known: join_timeout, last_call_timeout, join_window, close_timeout, exit_barrier_timeout, heartbeat, heartbeat_timeout, keep_alive_interval, keep_alive_max_attempt, timeout, read_timeout, is_host)"
    )]
    UnknownKey(String),
    #[error("--rdzv-conf: {key}={value:?} is not {expected}")]
    BadValue {
        key: String,
        value: String,
        expected: &'static str,
    },
}

/// Applies `key=value,...` to `cfg`.
pub fn parse_conf(cfg: &mut Config, conf: &str) -> Result<(), ConfError> {
    let mut keep_alive_attempts = None;
    for item in conf.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (key, value) = item
            .split_once('=')
            .ok_or_else(|| ConfError::NotKeyValue(item.to_string()))?;
        let (key, value) = (key.trim(), value.trim());
        let secs = || -> Result<Duration, ConfError> {
            value
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9)
                .map(Duration::from_secs_f64)
                .ok_or_else(|| ConfError::BadValue {
                    key: key.to_string(),
                    value: value.to_string(),
                    expected: "a positive number of seconds",
                })
        };
        match key {
            "join_timeout" => cfg.join_timeout = secs()?,
            "last_call_timeout" => cfg.last_call_timeout = secs()?,
            "join_window" => cfg.join_window = secs()?,
            "close_timeout" => cfg.close_timeout = secs()?,
            "exit_barrier_timeout" => cfg.exit_barrier_timeout = secs()?,
            "heartbeat" | "keep_alive_interval" => cfg.heartbeat = secs()?,
            "heartbeat_timeout" => cfg.heartbeat_timeout = secs()?,
            "timeout" | "read_timeout" => cfg.store_timeout = secs()?,
            "keep_alive_max_attempt" => {
                keep_alive_attempts = Some(value.parse::<u32>().ok().filter(|n| *n > 0).ok_or(
                    ConfError::BadValue {
                        key: key.to_string(),
                        value: value.to_string(),
                        expected: "a positive whole number",
                    },
                )?)
            }
            "is_host" => {
                cfg.is_host = Some(match value.to_ascii_lowercase().as_str() {
                    "1" | "true" | "yes" => true,
                    "0" | "false" | "no" => false,
                    _ => {
                        return Err(ConfError::BadValue {
                            key: key.to_string(),
                            value: value.to_string(),
                            expected: "true or false",
                        });
                    }
                })
            }
            other => return Err(ConfError::UnknownKey(other.to_string())),
        }
    }
    if let Some(n) = keep_alive_attempts {
        cfg.heartbeat_timeout = cfg.heartbeat * n;
    }
    if cfg.heartbeat_timeout < cfg.heartbeat * 2 {
        return Err(ConfError::BadValue {
            key: "heartbeat_timeout".into(),
            value: format!("{:?}", cfg.heartbeat_timeout),
            expected: "at least twice the heartbeat interval",
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config::new("r", Limits { min: 1, max: 2 })
    }

    #[test]
    fn torchrun_keys_and_ours_are_understood() {
        let mut c = cfg();
        parse_conf(
            &mut c,
            "join_timeout=30, last_call_timeout=0.5,heartbeat=0.25,heartbeat_timeout=1,is_host=false,join_window=5",
        )
        .unwrap();
        assert_eq!(c.is_host, Some(false));
        assert_eq!(c.join_timeout, Duration::from_secs(30));
        assert_eq!(c.last_call_timeout, Duration::from_millis(500));
        assert_eq!(c.heartbeat_timeout, Duration::from_secs(1));
        assert_eq!(c.join_window, Duration::from_secs(5));
        let mut c = cfg();
        parse_conf(&mut c, "keep_alive_interval=1,keep_alive_max_attempt=3").unwrap();
        assert_eq!(c.heartbeat_timeout, Duration::from_secs(3));
        let mut c = cfg();
        assert_eq!(parse_conf(&mut c, ""), Ok(()));
        assert_eq!(c.is_host, None);
    }

    #[test]
    fn bad_conf_names_the_value() {
        let err = parse_conf(&mut cfg(), "join_timeout=soon").unwrap_err();
        assert!(err.to_string().contains("join_timeout=\"soon\""), "{err}");
        let err = parse_conf(&mut cfg(), "jointimeout=3").unwrap_err();
        assert!(
            err.to_string().contains("unknown key \"jointimeout\""),
            "{err}"
        );
        assert!(parse_conf(&mut cfg(), "join_timeout").is_err());
        assert!(parse_conf(&mut cfg(), "heartbeat=1,heartbeat_timeout=1").is_err());
        assert!(parse_conf(&mut cfg(), "join_timeout=-1").is_err());
    }
}
