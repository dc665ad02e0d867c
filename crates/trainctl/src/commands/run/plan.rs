//! `trainctl run`'s flags turned into a launch plan, before anything starts: how many workers,
//! which nodes (a fixed set, or an elastic range with its rendezvous backend and endpoint), the
//! run id. Every refusal of a flag combination is here, tested without starting anything.

use anyhow::{Context, bail};
use contract::rdzv::Backend as RdzvBackend;
use launcher::rendezvous::BackendKind;
use launcher::rendezvous::Limits;

use super::Args;

/// What a `trainctl run` will do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Plan {
    pub(super) nproc_per_node: u32,
    /// `--rdzv-id`, else `local` (one static node) or `none`.
    pub(super) run_id: String,
    pub(super) topology: Topology,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Topology {
    /// A fixed set of nodes: torchrun's static rendezvous (or `--standalone`).
    Static {
        nnodes: u32,
        master_addr: String,
        /// `None`: a free port of this node, picked at launch (one node only).
        master_port: Option<u16>,
    },
    /// This node's elastic agent, in a job of `limits` nodes.
    Elastic { limits: Limits, endpoint: Endpoint },
}

/// Where the elastic rendezvous lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Endpoint {
    /// As given (or defaulted), for messages.
    pub(super) given: String,
    pub(super) backend: BackendKind,
}

/// `--standalone` makes its own one-node rendezvous: settings for another are refused, not
/// ignored (torchrun only warns), so a job meant to span nodes does not run alone.
fn check_standalone(args: &Args) -> anyhow::Result<()> {
    let ignored: Vec<String> = [
        (args.nnodes != "1").then(|| format!("--nnodes {}", args.nnodes)),
        args.rdzv_backend
            .filter(|b| !matches!(b, RdzvBackend::Static | RdzvBackend::C10d))
            .map(|b| format!("--rdzv-backend {b}")),
        args.rdzv_endpoint
            .as_ref()
            .map(|e| format!("--rdzv-endpoint {e}")),
        (args.node_rank != 0).then(|| format!("--node-rank {}", args.node_rank)),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !ignored.is_empty() {
        bail!(
            "--standalone runs one node with its own rendezvous on this host; it cannot take {}: drop --standalone for a job across nodes, or drop the others",
            ignored.join(" ")
        );
    }
    Ok(())
}

impl Plan {
    pub(super) fn from_args(args: &Args) -> anyhow::Result<Plan> {
        let nproc_per_node = parse_nproc(&args.nproc_per_node)?;
        if let Some(id) = &args.run_id {
            check_run_id(id)?;
        }
        let limits = if args.standalone {
            check_standalone(args)?;
            Limits { min: 1, max: 1 }
        } else {
            parse_nnodes(&args.nnodes)?
        };
        let backend = match args.rdzv_backend {
            Some(RdzvBackend::EtcdV2) => bail!(
                "--rdzv-backend etcd-v2: trainctl speaks etcd's v3 API only (no --enable-v2 needed); use --rdzv-backend etcd"
            ),
            Some(b) => b,
            None if args.standalone => RdzvBackend::Static,
            None if args.rdzv_endpoint.is_some() || limits.min != limits.max => RdzvBackend::C10d,
            None => RdzvBackend::Static,
        };
        if backend != RdzvBackend::Static {
            return Ok(Plan {
                nproc_per_node,
                run_id: args.run_id.clone().unwrap_or_else(|| "none".into()),
                topology: Topology::Elastic {
                    limits,
                    endpoint: endpoint(args, limits, backend)?,
                },
            });
        }
        if limits.min != limits.max {
            bail!(
                "--nnodes {}: a MIN:MAX range needs an elastic rendezvous; add --rdzv-backend c10d --rdzv-endpoint HOST[:PORT]",
                args.nnodes
            );
        }
        let nnodes = limits.max;
        if args.node_rank >= nnodes {
            bail!(
                "--node-rank {} is not below --nnodes {nnodes}",
                args.node_rank
            );
        }
        let (master_addr, master_port) = if args.standalone || args.master_port == 0 {
            if nnodes > 1 {
                bail!(
                    "--master-port 0 picks a free port on this node, which other nodes cannot know: give a port"
                );
            }
            let addr = if args.standalone {
                "127.0.0.1".to_string()
            } else {
                args.master_addr.clone()
            };
            (addr, None)
        } else {
            (args.master_addr.clone(), Some(args.master_port))
        };
        if nnodes > 1 && args.max_restarts > 0 {
            bail!(
                "--max-restarts {} with --nnodes {nnodes} and a static rendezvous: every node must restart together, which is the elastic agent's job; add --rdzv-backend c10d --rdzv-endpoint HOST[:PORT] (or use --max-restarts 0)",
                args.max_restarts
            );
        }
        let run_id = args.run_id.clone().unwrap_or_else(|| {
            if nnodes == 1 {
                "local".into()
            } else {
                "none".into()
            }
        });
        Ok(Plan {
            nproc_per_node,
            run_id,
            topology: Topology::Static {
                nnodes,
                master_addr,
                master_port,
            },
        })
    }
}

/// The rendezvous endpoint of `backend` (`c10d` or `etcd`): given, or this host for a job of
/// one node.
fn endpoint(args: &Args, limits: Limits, backend: RdzvBackend) -> anyhow::Result<Endpoint> {
    let given = match (&args.rdzv_endpoint, limits.max) {
        (Some(e), _) => e.clone(),
        (None, 1) => "127.0.0.1".into(),
        (None, _) => bail!(
            "--rdzv-backend {backend} with several nodes needs --rdzv-endpoint HOST[:PORT]: the address every node can reach the store at"
        ),
    };
    let backend = match backend {
        RdzvBackend::Etcd => {
            let url = if given.contains("://") {
                given.clone()
            } else {
                let (host, port) = split_endpoint(&given, contract::ports::ETCD)?;
                format!("http://{host}:{port}")
            };
            BackendKind::Etcd { url }
        }
        _ => {
            let (host, port) = split_endpoint(&given, contract::ports::C10D)?;
            BackendKind::C10d { host, port }
        }
    };
    Ok(Endpoint { given, backend })
}

fn parse_nproc(v: &str) -> anyhow::Result<u32> {
    match v {
        "auto" | "cpu" => Ok(std::thread::available_parallelism().map_or(1, |n| n.get() as u32)),
        "gpu" => {
            bail!("--nproc-per-node gpu: this build has no GPU backend; use a number or `cpu`")
        }
        n => match n.parse::<u32>() {
            Ok(n) if n > 0 => Ok(n),
            _ => bail!("--nproc-per-node must be a positive number, `auto` or `cpu`, got {n:?}"),
        },
    }
}

fn parse_nnodes(v: &str) -> anyhow::Result<Limits> {
    let (min, max) = v.split_once(':').unwrap_or((v, v));
    let parse = |s: &str| s.trim().parse::<u32>().ok().filter(|&n| n > 0);
    match (parse(min), parse(max)) {
        (Some(min), Some(max)) if min <= max => Ok(Limits { min, max }),
        (Some(min), Some(max)) => {
            bail!("--nnodes {v}: MIN ({min}) is larger than MAX ({max}); write MIN:MAX")
        }
        _ => bail!("--nnodes must be a positive number or MIN:MAX, got {v:?}"),
    }
}

/// HOST and PORT of `--rdzv-endpoint`, with `default_port` when none is given.
fn split_endpoint(endpoint: &str, default_port: u16) -> anyhow::Result<(String, u16)> {
    let endpoint = endpoint.trim();
    let (host, port) = match endpoint.rsplit_once(':') {
        // A bare IPv6 address has colons but no port.
        Some((h, p)) if !h.is_empty() && (!h.contains(':') || h.ends_with(']')) => {
            let port = p.parse::<u16>().with_context(|| {
                format!("--rdzv-endpoint {endpoint:?}: port {p:?} is not a number from 0 to 65535")
            })?;
            (h, port)
        }
        _ => (endpoint, default_port),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        bail!("--rdzv-endpoint {endpoint:?}: no host; give HOST[:PORT]");
    }
    Ok((host.to_string(), port))
}

/// A run id names the job's log and scratch folders: one plain name.
fn check_run_id(id: &str) -> anyhow::Result<()> {
    if id.is_empty() {
        bail!("--rdzv-id is empty: give the job a name (letters, digits, '-', '_', '.')");
    }
    if id.contains('/') || id.contains('\0') || id == "." || id == ".." {
        bail!(
            "--rdzv-id {id:?} names folders (it becomes a folder of --log-dir): use one plain name such as {:?}",
            id.replace(['/', '\0'], "-").trim_matches('.')
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::{Cli, Command};

    fn plan(flags: &[&str]) -> anyhow::Result<Plan> {
        let argv = ["trainctl", "run"].iter().chain(flags).chain(&["train"]);
        let Command::Run(args) = Cli::try_parse_from(argv).unwrap().command else {
            unreachable!("a run command line")
        };
        Plan::from_args(&args)
    }

    fn refused(flags: &[&str]) -> String {
        format!("{:#}", plan(flags).unwrap_err())
    }

    #[test]
    fn standalone_is_one_node_on_loopback_with_a_free_port() {
        let p = plan(&["--standalone", "--nproc-per-node", "3"]).unwrap();
        assert_eq!(p.nproc_per_node, 3);
        assert_eq!(p.run_id, "local");
        assert_eq!(
            p.topology,
            Topology::Static {
                nnodes: 1,
                master_addr: "127.0.0.1".into(),
                master_port: None
            }
        );
    }

    #[test]
    fn static_nodes_keep_the_given_master() {
        let p = plan(&[
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "node0",
            "--master-port",
            "1234",
        ])
        .unwrap();
        assert_eq!(p.run_id, "none");
        assert_eq!(
            p.topology,
            Topology::Static {
                nnodes: 2,
                master_addr: "node0".into(),
                master_port: Some(1234)
            }
        );
    }

    #[test]
    fn a_range_or_an_endpoint_means_c10d_with_its_default_port() {
        for flags in [
            &["--nnodes", "1:3", "--rdzv-endpoint", "host"][..],
            &["--rdzv-endpoint", "host"][..],
        ] {
            let Topology::Elastic { endpoint, .. } = plan(flags).unwrap().topology else {
                panic!("{flags:?}: not elastic");
            };
            assert_eq!(
                endpoint.backend,
                BackendKind::C10d {
                    host: "host".into(),
                    port: contract::ports::C10D
                }
            );
        }
    }

    #[test]
    fn etcd_endpoints_become_urls() {
        let url = |endpoint: &str| {
            let p = plan(&[
                "--nnodes",
                "2",
                "--rdzv-backend",
                "etcd",
                "--rdzv-endpoint",
                endpoint,
            ]);
            match p.unwrap().topology {
                Topology::Elastic {
                    endpoint:
                        Endpoint {
                            backend: BackendKind::Etcd { url },
                            ..
                        },
                    ..
                } => url,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(
            url("etcd"),
            format!("http://etcd:{}", contract::ports::ETCD)
        );
        assert_eq!(url("https://etcd:1"), "https://etcd:1");
    }

    #[test]
    fn combinations_that_cannot_work_are_refused_saying_what_to_pass() {
        for (flags, says) in [
            (
                &["--rdzv-backend", "etcd-v2"][..],
                "use --rdzv-backend etcd",
            ),
            (
                &["--nnodes", "1:3", "--rdzv-backend", "static"][..],
                "needs an elastic rendezvous",
            ),
            (
                &["--nnodes", "2", "--node-rank", "2"][..],
                "--node-rank 2 is not below --nnodes 2",
            ),
            (&["--nnodes", "2", "--master-port", "0"][..], "give a port"),
            (
                &["--nnodes", "2", "--max-restarts", "1"][..],
                "add --rdzv-backend c10d",
            ),
            (
                &["--nnodes", "2", "--rdzv-backend", "c10d"][..],
                "needs --rdzv-endpoint",
            ),
            (&["--nnodes", "3:2"][..], "MIN (3) is larger than MAX (2)"),
            (&["--nproc-per-node", "0"][..], "positive number"),
            (
                &["--rdzv-endpoint", "host:port"][..],
                "port \"port\" is not a number",
            ),
            (
                &["--standalone", "--rdzv-id", "a/../../b"][..],
                "--rdzv-id \"a/../../b\" names folders",
            ),
            (&["--standalone", "--rdzv-id", ""][..], "--rdzv-id is empty"),
            (
                &["--standalone", "--rdzv-endpoint", "h:29400"][..],
                "--standalone runs one node with its own rendezvous on this host; it cannot take --rdzv-endpoint h:29400: drop --standalone",
            ),
            (
                &["--standalone", "--nnodes", "1:2", "--rdzv-backend", "etcd"][..],
                "cannot take --nnodes 1:2 --rdzv-backend etcd",
            ),
        ] {
            let err = refused(flags);
            assert!(err.contains(says), "{flags:?}: {err}");
        }
    }
}
