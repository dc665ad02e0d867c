//! The torchrun worker-environment contract, read in one place.
//!
//! Invariant: this is the only module of the workspace that reads the worker environment
//! (RANK, WORLD_SIZE, MASTER_ADDR, ...). The launcher writes the same names (`contract::env`).

use std::time::Duration;

use contract::env as vars;

#[derive(Debug, thiserror::Error)]
pub enum WorldError {
    #[error("environment variable {name}={value:?} is not {expected}")]
    Invalid {
        name: &'static str,
        value: String,
        expected: &'static str,
    },
    #[error("RANK={rank} is not below WORLD_SIZE={world_size}")]
    RankOutOfRange { rank: u32, world_size: u32 },
}

/// Where this process stands in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct World {
    pub rank: u32,
    pub world_size: u32,
    pub local_rank: u32,
    pub local_world_size: u32,
    pub group_rank: u32,
    pub master_addr: String,
    pub master_port: u16,
    pub run_id: String,
    pub token: String,
    pub restart_count: u32,
    pub max_restarts: u32,
    pub timeout: Duration,
    /// Where `trainctl run` listens for this worker's metrics records.
    pub telemetry_fd: Option<i32>,
    /// Where this worker hears of the next round from its elastic agent
    /// ([`crate::control`]); none: a changed group restarts the worker.
    pub control_fd: Option<i32>,
    /// What the node's health check measured (matrix multiply MFLOP/s, loopback MB/s), when
    /// its agent ran one.
    pub node_health: Option<(u64, u64)>,
    /// Started warm (`contract::env::WARM_START`): its node has no place in the job yet, so
    /// `rank`, `world_size` and the master are placeholders until the agent hands the round.
    pub warm: bool,
}

pub(crate) const DEFAULT_MASTER_PORT: u16 = contract::ports::MASTER;
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

impl World {
    /// Rank `rank` of `world_size` on this one host (threads or processes), rank 0's store on
    /// 127.0.0.1:`master_port`: benchmarks and in-process tests of the collective.
    pub fn loopback(rank: u32, world_size: u32, master_port: u16, run_id: &str) -> Self {
        World {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            master_port,
            run_id: run_id.into(),
            ..World::single()
        }
    }

    /// A single process with nobody to talk to: what `trainctl train` is when run by hand.
    pub fn single() -> Self {
        World {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            group_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            // As `trainctl run --standalone` names a one-node run: its files go to runs/local/.
            run_id: "local".into(),
            token: String::new(),
            restart_count: 0,
            max_restarts: 0,
            timeout: DEFAULT_TIMEOUT,
            telemetry_fd: None,
            control_fd: None,
            node_health: None,
            warm: false,
        }
    }

    /// Reads the worker environment. Without RANK and WORLD_SIZE this is a single process.
    #[allow(clippy::disallowed_methods)] // the one place that reads the environment
    pub fn from_env() -> Result<Self, WorldError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the contract through `lookup`, so tests need not touch the process environment.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, WorldError> {
        let single = World::single();
        let warm = lookup(vars::WARM_START).is_some_and(|v| v.trim() == "1");
        // A warm worker has no round yet: its node's own size stands in until it has one.
        let Some(world_size) = lookup(vars::WORLD_SIZE)
            .or_else(|| warm.then(|| lookup(vars::LOCAL_WORLD_SIZE).unwrap_or("1".into())))
        else {
            return Ok(single);
        };
        let world_size = parse_u32(vars::WORLD_SIZE, &world_size)?;
        if world_size == 0 {
            return Err(WorldError::Invalid {
                name: vars::WORLD_SIZE,
                value: "0".into(),
                expected: "a positive integer",
            });
        }
        let num = |name: &'static str, default: u32| -> Result<u32, WorldError> {
            lookup(name).map_or(Ok(default), |v| parse_u32(name, &v))
        };
        let rank = num(vars::RANK, if warm { num(vars::LOCAL_RANK, 0)? } else { 0 })?;
        if rank >= world_size {
            return Err(WorldError::RankOutOfRange { rank, world_size });
        }
        let master_port = match lookup(vars::MASTER_PORT) {
            None => DEFAULT_MASTER_PORT,
            Some(v) => v.trim().parse::<u16>().map_err(|_| WorldError::Invalid {
                name: vars::MASTER_PORT,
                value: v,
                expected: "a TCP port (0-65535)",
            })?,
        };
        let timeout = match lookup(vars::COLLECTIVE_TIMEOUT) {
            None => DEFAULT_TIMEOUT,
            Some(v) => match v.trim().parse::<f64>() {
                Ok(s) if s > 0.0 && s.is_finite() => Duration::from_secs_f64(s),
                _ => {
                    return Err(WorldError::Invalid {
                        name: vars::COLLECTIVE_TIMEOUT,
                        value: v,
                        expected: "a positive number of seconds",
                    });
                }
            },
        };
        let fd = |name: &'static str| match lookup(name) {
            None => Ok(None),
            Some(v) => v
                .trim()
                .parse::<i32>()
                .ok()
                .filter(|fd| *fd > 2)
                .map(Some)
                .ok_or(WorldError::Invalid {
                    name,
                    value: v,
                    expected: "a file descriptor number above 2",
                }),
        };
        Ok(World {
            rank,
            world_size,
            local_rank: num(vars::LOCAL_RANK, rank)?,
            local_world_size: num(vars::LOCAL_WORLD_SIZE, world_size)?,
            group_rank: num(vars::GROUP_RANK, 0)?,
            master_addr: lookup(vars::MASTER_ADDR).unwrap_or(single.master_addr),
            master_port,
            run_id: lookup(vars::RUN_ID).unwrap_or(single.run_id),
            token: lookup(vars::JOB_TOKEN).unwrap_or_default(),
            restart_count: num(vars::RESTART_COUNT, 0)?,
            max_restarts: num(vars::MAX_RESTARTS, 0)?,
            timeout,
            telemetry_fd: fd(vars::TELEMETRY_FD)?,
            control_fd: fd(vars::CONTROL_FD)?,
            // Only the agent writes it: one that does not read is as none.
            node_health: lookup(vars::NODE_HEALTH).and_then(|v| {
                let (g, l) = v.split_once(',')?;
                Some((g.trim().parse().ok()?, l.trim().parse().ok()?))
            }),
            warm,
        })
    }
}

/// Whether the launcher's own environment sets `name` (torchrun keeps a user's OMP_NUM_THREADS).
#[allow(clippy::disallowed_methods)] // the one place that reads the environment
pub fn is_set(name: &str) -> bool {
    std::env::var_os(name).is_some()
}

fn parse_u32(name: &'static str, value: &str) -> Result<u32, WorldError> {
    value.trim().parse().map_err(|_| WorldError::Invalid {
        name,
        value: value.to_string(),
        expected: "a non-negative integer",
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn world(pairs: &[(&str, &str)]) -> Result<World, WorldError> {
        let env: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        World::from_lookup(|k| env.get(k).cloned())
    }

    #[test]
    fn no_environment_is_a_single_process() {
        assert_eq!(world(&[]).unwrap(), World::single());
    }

    #[test]
    fn reads_the_torchrun_contract() {
        let w = world(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("GROUP_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
            ("TORCHELASTIC_RUN_ID", "job"),
            ("TRAINCTL_JOB_TOKEN", "s3cret"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ])
        .unwrap();
        assert_eq!(
            (w.rank, w.world_size, w.local_rank, w.group_rank),
            (3, 4, 1, 1)
        );
        assert_eq!((w.master_addr.as_str(), w.master_port), ("node0", 1234));
        assert_eq!(
            (w.run_id.as_str(), w.token.as_str(), w.restart_count),
            ("job", "s3cret", 2)
        );
    }

    #[test]
    fn bad_values_name_the_variable_and_value() {
        let err = world(&[("WORLD_SIZE", "two")]).unwrap_err().to_string();
        assert!(err.contains("WORLD_SIZE") && err.contains("two"), "{err}");
        let err = world(&[("WORLD_SIZE", "2"), ("RANK", "2")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("RANK=2"), "{err}");
        let err = world(&[("WORLD_SIZE", "2"), ("MASTER_PORT", "99999")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("99999"), "{err}");
    }
}
