//! The contract's command lines, rendered by deploy for a job's pods and parsed back by this
//! binary's own parser: every flag deploy writes reads back as the value it meant.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::Parser;
use contract::argv::{RunArgs, RunFlag, Target, TrainArgs};
use contract::choices::{Choice, Model, Precision};
use deploy::config::Project;

use crate::{Cli, Command};

fn parse(argv: Vec<String>) -> Command {
    let argv = std::iter::once("trainctl".to_string()).chain(argv);
    match Cli::try_parse_from(argv) {
        Ok(cli) => cli.command,
        Err(e) => panic!("the CLI refuses a rendered command line: {e}"),
    }
}

/// Parses `run`'s argv and checks each of its flags, then its target.
fn assert_round_trip(run: &RunArgs) {
    let Command::Run(args) = parse(run.to_argv()) else {
        panic!("not `trainctl run`: {:?}", run.to_argv());
    };
    for flag in &run.flags {
        match flag {
            RunFlag::Nnodes(n) => assert_eq!(&args.nnodes, n),
            RunFlag::NprocPerNode(n) => assert_eq!(args.nproc_per_node, n.to_string()),
            RunFlag::RdzvBackend(b) => assert_eq!(args.rdzv_backend.as_ref(), Some(b)),
            RunFlag::RdzvEndpoint(e) => assert_eq!(args.rdzv_endpoint.as_ref(), Some(e)),
            RunFlag::RdzvId(id) => assert_eq!(args.run_id.as_ref(), Some(id)),
            RunFlag::MaxRestarts(n) => assert_eq!(args.max_restarts, *n),
            RunFlag::MetricsPort(p) => assert_eq!(args.metrics_port, Some(*p)),
            RunFlag::GracePeriod(s) => assert_eq!(args.grace_period, *s as f64),
            RunFlag::Fetch(uri) => assert!(args.fetch.contains(uri), "{uri}"),
            RunFlag::FetchDir(d) => assert_eq!(args.fetch_dir, PathBuf::from(d)),
            RunFlag::HangTimeout(s) => assert_eq!(args.hang_timeout, Some(*s as f64)),
            RunFlag::TerminationLog(p) => {
                assert_eq!(args.termination_log.as_deref(), Some(p.as_ref()))
            }
            RunFlag::Stragglers(v) => assert_eq!(args.stragglers, *v),
            RunFlag::HealthCheck(v) => assert_eq!(args.health_check, *v),
        }
    }
    let fetched = run
        .flags
        .iter()
        .filter(|f| matches!(f, RunFlag::Fetch(_)))
        .count();
    assert_eq!(args.fetch.len(), fetched, "every --fetch, once");
    match &run.target {
        Target::Program(program) => {
            let program: Vec<OsString> = program.iter().map(OsString::from).collect();
            assert_eq!(args.command, program);
        }
        Target::Train(train) => {
            let command: Vec<String> = args
                .command
                .iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect();
            assert_eq!(
                command,
                train.to_argv(),
                "the trainer's arguments pass through"
            );
            assert_train_round_trip(train);
        }
    }
}

/// A value-enum flag's value as its command line spells it.
fn assert_train_round_trip(train: &TrainArgs) {
    let Command::Train(args) = parse(train.to_argv()) else {
        panic!("not `trainctl train`: {:?}", train.to_argv());
    };
    assert_eq!(args.model, train.model);
    assert_eq!(args.data, PathBuf::from(&train.data));
    assert_eq!(args.out, PathBuf::from(&train.out));
    assert_eq!(args.epochs, train.epochs as usize);
    assert_eq!(args.batch_size, train.batch_size as usize);
    assert_eq!(args.learning_rate, train.learning_rate, "exactly");
    assert_eq!(args.no_download, train.no_download);
    assert_eq!(args.upload, train.upload);
    assert_eq!(args.precision, train.precision);
    assert_eq!(args.train_again, train.train_again);
}

fn project(settings: &[(&'static str, &str)]) -> Project {
    Project::from_settings(settings).unwrap_or_else(|e| panic!("{e}"))
}

/// The pods of every kind of job deploy renders: both launchers, fixed and elastic, c10d and
/// etcd, the built-in trainer with every setting it passes, and a user's program.
#[test]
fn every_rendered_worker_command_parses_back_to_what_deploy_meant() {
    let jobs = [
        project(&[]),
        project(&[
            ("job.model", "resnet50"),
            ("job.epochs", "3"),
            ("job.batch_size", "48"),
            ("job.learning_rate", "0.0123456789"),
            ("job.upload", "s3://bucket/runs"),
            ("job.precision", "bf16"),
            ("job.nnodes", "2:4"),
            ("job.rdzv_backend", "etcd"),
            ("job.max_restarts", "7"),
            ("job.metrics_port", "0"),
        ]),
        project(&[("job.launcher", "pytorchjob"), ("job.nnodes", "3")]),
        project(&[("job.launcher", "pytorchjob"), ("job.nnodes", "1:3")]),
        project(&[
            ("job.launcher", "pytorchjob"),
            ("job.nnodes", "1:3"),
            ("job.rdzv_backend", "etcd"),
        ]),
        project(&[
            ("job.command", "python3 main.py --lr 0.1 -- --weird"),
            ("job.fetch", "s3://bucket/code s3://bucket/more/main.py"),
            ("job.nproc_per_node", "4"),
            ("job.hang_timeout", "600"),
            ("job.stragglers", "evict"),
            ("job.health_check", "refuse"),
        ]),
    ];
    let mut seen = std::collections::BTreeSet::new();
    for job in &jobs {
        let run = deploy::launchers::worker_run_args(job);
        for flag in &run.flags {
            seen.insert(flag.flag());
        }
        assert_round_trip(&run);
    }
    // Each kind of flag deploy can write was exercised above.
    assert_eq!(seen.len(), 14, "{seen:?}");
}

/// A model other than the default, and values at their edges, read back exactly.
#[test]
fn train_arguments_read_back_exactly() {
    for &model in <Model as Choice>::ALL {
        assert_train_round_trip(&TrainArgs {
            model,
            data: "/data/with space".into(),
            out: "/runs".into(),
            epochs: u32::MAX,
            batch_size: 1,
            learning_rate: 1e-7,
            no_download: false,
            upload: None,
            precision: Precision::Bf16,
            train_again: model == Model::SeedCnn,
        });
    }
}
