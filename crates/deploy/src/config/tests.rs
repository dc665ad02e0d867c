use std::collections::HashMap;

use super::*;

fn resolve(
    flags: &[(&'static str, &str)],
    env: &[(&str, &str)],
    file: Option<&str>,
) -> Result<(Resolved, Project), ConfigError> {
    let env: HashMap<String, String> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let lookup = move |k: &str| env.get(k).cloned();
    let layers = Layers {
        flags: flags.iter().map(|(k, v)| (*k, v.to_string())).collect(),
        env: &lookup,
        file: file.map(|t| (PathBuf::from("trainctl.toml"), t.to_string())),
    };
    let r = Resolved::resolve(&layers)?;
    let p = Project::from_resolved(&r)?;
    Ok((r, p))
}

fn error(flags: &[(&'static str, &str)], env: &[(&str, &str)], file: Option<&str>) -> String {
    match resolve(flags, env, file) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn flag_beats_environment_beats_file_beats_default() {
    let file = "[cluster]\nnodes = 4\nregion = \"eu-west-1\"\nname = \"from-file\"\n";
    let env = [
        ("TRAINCTL_CLUSTER_NODES", "3"),
        ("TRAINCTL_CLUSTER_REGION", "eu-central-1"),
    ];
    let (r, p) = resolve(&[("cluster.nodes", "5")], &env, Some(file)).unwrap();
    assert_eq!(p.cluster.nodes, 5);
    assert_eq!(r.values["cluster.nodes"].1, Source::Flag("--nodes"));
    assert_eq!(p.cluster.region, "eu-central-1");
    assert_eq!(
        r.values["cluster.region"].1,
        Source::Env("TRAINCTL_CLUSTER_REGION".into())
    );
    assert_eq!(p.cluster.name, "from-file");
    assert_eq!(
        r.values["cluster.name"].1,
        Source::File("trainctl.toml".into())
    );
    assert_eq!(p.cluster.version, "1.33");
    assert_eq!(r.values["cluster.version"].1, Source::Default);
}

#[test]
fn an_empty_variable_does_not_hide_the_file() {
    let (_, p) = resolve(&[], &[("TRAINCTL_IMAGE", "")], Some("image = \"x:1\"\n")).unwrap();
    assert_eq!(p.image, "x:1");
}

#[test]
fn the_preset_sets_the_instance_type_and_the_pod_size_follows() {
    let (r, p) = resolve(&[("cluster.preset", "g4dn")], &[], None).unwrap();
    assert_eq!(p.cluster.instance_type.name, "g4dn.metal");
    assert_eq!(r.values["cluster.instance_type"].1, Source::Preset("g4dn"));
    assert_eq!(p.job.gpus_per_node, 8);
    assert_eq!(p.job.cpu, "81");
    assert_eq!(
        r.values["job.cpu"].1,
        Source::Derived("cluster.instance_type")
    );
    // An explicit instance type beats the preset.
    let (_, p) = resolve(
        &[("cluster.preset", "g4dn")],
        &[("TRAINCTL_CLUSTER_INSTANCE_TYPE", "g4dn.12xlarge")],
        None,
    )
    .unwrap();
    assert_eq!(p.cluster.instance_type.name, "g4dn.12xlarge");
    assert_eq!(p.job.gpus_per_node, 4);
}

#[test]
fn paths_follow_the_mount_path() {
    let (_, p) = resolve(&[("storage.mount_path", "/mnt/shared/")], &[], None).unwrap();
    assert_eq!(p.data.dir, "/mnt/shared/cifar10");
    assert_eq!(p.job.run_dir(), "/mnt/shared/runs/cifar10");
    assert_eq!(
        p.job.model_path(),
        "/mnt/shared/runs/cifar10/model.safetensors"
    );
}

#[test]
fn nnodes_defaults_to_the_node_count_and_takes_a_range() {
    let (_, p) = resolve(&[("cluster.nodes", "3")], &[], None).unwrap();
    assert_eq!((p.job.min_nodes, p.job.max_nodes), (3, 3));
    assert!(!p.job.is_elastic());
    let (_, p) = resolve(&[("job.nnodes", "1:4")], &[], None).unwrap();
    assert_eq!(p.job.nnodes(), "1:4");
    assert!(p.job.is_elastic());
}

#[test]
fn bad_values_are_named_with_their_value_and_source() {
    let e = error(&[("cluster.instance_type", "c5.huge")], &[], None);
    assert!(
        e.contains("cluster.instance_type = \"c5.huge\" (from flag --instance-type)"),
        "{e}"
    );
    assert!(e.contains("unknown instance type; known: c5.xlarge"), "{e}");

    let e = error(&[], &[("TRAINCTL_CLUSTER_NODES", "0")], None);
    assert!(
        e.contains(
            "cluster.nodes = \"0\" (from environment TRAINCTL_CLUSTER_NODES): must be at least 1"
        ),
        "{e}"
    );

    let e = error(&[], &[], Some("[job]\nname = \"My_Job\"\n"));
    assert!(
        e.contains("job.name = \"My_Job\" (from file trainctl.toml): not a valid job name"),
        "{e}"
    );

    let e = error(&[("namespace", "-x")], &[], None);
    assert!(e.contains("DNS-1123 label"), "{e}");
    let e = error(&[("job.nnodes", "3:1")], &[], None);
    assert!(e.contains("MIN is larger than MAX"), "{e}");
    let e = error(&[("job.gpus_per_node", "2")], &[], None);
    assert!(e.contains("c5.4xlarge has 0 GPUs per node"), "{e}");
    let e = error(&[("job.memory", "lots")], &[], None);
    assert!(e.contains("expected a quantity such as 24Gi"), "{e}");
    let e = error(
        &[("storage.efs", "fs-1"), ("storage.fsx", "a,b,c")],
        &[],
        None,
    );
    assert!(e.contains("choose one"), "{e}");
    let e = error(&[("cluster.preset", "gpu")], &[], None);
    assert!(e.contains("choose one of cpu, g4dn, p4de-odcr, p5"), "{e}");
    let long = "a".repeat(MAX_JOB_NAME + 1);
    let e = error(&[("job.name", long.as_str())], &[], None);
    assert!(e.contains("at most 45"), "{e}");
}

#[test]
fn the_file_is_checked_for_typos_and_syntax() {
    let e = error(&[], &[], Some("[cluster]\nnode = 2\n"));
    assert!(e.contains("unknown setting `cluster.node`"), "{e}");
    assert!(e.contains("cluster.nodes"), "{e}");
    let e = error(&[], &[], Some("[cluster\n"));
    assert!(e.starts_with("trainctl.toml: not valid TOML"), "{e}");
    let (_, p) = resolve(
        &[],
        &[],
        Some("[cluster]\navailability_zones = [\"us-west-2a\", \"us-west-2b\"]\n"),
    )
    .unwrap();
    assert_eq!(p.cluster.availability_zones, ["us-west-2a", "us-west-2b"]);
}

#[test]
fn storage_backends_parse() {
    let (_, p) = resolve(&[("storage.efs", "fs-0abc")], &[], None).unwrap();
    assert_eq!(
        p.storage.backend,
        Some(StorageBackend::Efs {
            file_system_id: "fs-0abc".into()
        })
    );
    let (_, p) = resolve(
        &[(
            "storage.fsx",
            "fs-1, fs-1.fsx.us-west-2.amazonaws.com, abcd",
        )],
        &[],
        None,
    )
    .unwrap();
    assert!(
        matches!(p.storage.backend, Some(StorageBackend::Fsx { ref mount_name, .. }) if mount_name == "abcd")
    );
    let e = error(&[("storage.fsx", "fs-1")], &[], None);
    assert!(e.contains("FS_ID,DNS_NAME,MOUNT_NAME"), "{e}");
}

#[test]
fn every_setting_has_a_distinct_flag_and_variable() {
    let mut flags: Vec<_> = SETTINGS
        .iter()
        .flat_map(|s| std::iter::once(s.flag).chain(s.alias))
        .collect();
    let given = flags.len();
    flags.sort_unstable();
    flags.dedup();
    assert_eq!(flags.len(), given, "a flag or alias names two settings");
    assert_eq!(
        setting("job.learning_rate").unwrap().alias,
        Some("--lr"),
        "the old flag keeps working"
    );
    assert_eq!(
        setting("job.max_restarts").unwrap().env_var(),
        "TRAINCTL_JOB_MAX_RESTARTS"
    );
}

#[test]
fn quantities() {
    for ok in ["1", "500m", "24Gi", "0.5", "100Gi", "2G"] {
        assert!(is_quantity(ok), "{ok}");
    }
    for bad in ["", "Gi", "-1", "1.2.3Gi", "lots", "1 Gi", "0"] {
        assert!(!is_quantity(bad), "{bad}");
    }
}

/// A command given as a list in trainctl.toml comes back word for word (spaces, quotes), and
/// the same command as shell words in a variable means the same.
#[test]
fn a_command_list_in_the_file_keeps_its_words() {
    let file = r#"
image = "pytorch/pytorch:2.5.1"
trainctl_image = "ecr/trainctl:1"
[job]
command = ["python", "main.py", "--note", "it's two words", "--empty", ""]
"#;
    let no_env = |_: &str| None;
    let layers = Layers {
        flags: vec![],
        env: &no_env,
        file: Some((PathBuf::from("trainctl.toml"), file.to_string())),
    };
    let p = Project::from_resolved(&Resolved::resolve(&layers).unwrap()).unwrap();
    let words = [
        "python",
        "main.py",
        "--note",
        "it's two words",
        "--empty",
        "",
    ];
    assert_eq!(p.job.command.as_deref().unwrap(), words);
    let env = |k: &str| (k == "TRAINCTL_JOB_COMMAND").then(|| join_words(&words).unwrap());
    let layers = Layers {
        flags: vec![],
        env: &env,
        file: Some((
            PathBuf::from("trainctl.toml"),
            file.replace("command", "# command"),
        )),
    };
    let p = Project::from_resolved(&Resolved::resolve(&layers).unwrap()).unwrap();
    assert_eq!(p.job.command.as_deref().unwrap(), words);
    let bad = "[job]\ncommand = [\"python\", 3]\n";
    let layers = Layers {
        flags: vec![],
        env: &no_env,
        file: Some((PathBuf::from("trainctl.toml"), bad.to_string())),
    };
    let e = Resolved::resolve(&layers).err().unwrap().to_string();
    assert!(e.contains("expected a list of strings"), "{e}");
}

/// Every setting is read by some command, whose `--help` lists it; the training job reads
/// every `job.*` setting but the helpers' own.
#[test]
fn every_setting_is_listed_by_the_commands_that_read_it() {
    for s in SETTINGS {
        assert!(!s.used_by.is_empty(), "{} is read by no command", s.key);
        if s.key.starts_with("job.") {
            assert!(s.used_by_any(&[UsedBy::Training]), "{}", s.key);
        }
    }
    let lookup: Vec<_> = SETTINGS
        .iter()
        .filter(|s| s.used_by_any(&[UsedBy::Lookup]))
        .map(|s| s.key)
        .collect();
    assert_eq!(lookup, ["namespace", "job.name"]);
}

/// The defaults written as text in the settings table are the values the rest of trainctl
/// means: the ports, the rendezvous backend and the launcher named in one place each.
#[test]
fn the_tables_defaults_are_the_constants_they_stand_for() {
    let default = |key: &str| setting(key).and_then(|s| s.default).unwrap();
    assert_eq!(default("job.rdzv_port"), contract::ports::C10D.to_string());
    assert_eq!(
        default("job.metrics_port"),
        contract::ports::METRICS.to_string()
    );
    assert_eq!(
        default("job.rdzv_backend"),
        contract::rdzv::Backend::C10d.name()
    );
    assert_eq!(default("job.launcher"), super::Launcher::ALL[0].name());
    // Every default is a value its own setting accepts: the project of defaults reads.
    Project::from_settings(&[("storage.efs", "fs-1")]).unwrap();
}

/// Every row's parser refuses a value it cannot read, naming the setting, the value and where
/// it came from, before anything is built from it.
#[test]
fn every_rows_parser_refuses_a_bad_value_naming_the_setting() {
    for s in SETTINGS {
        if matches!(s.parse, Parse::Typed | Parse::Text) {
            continue;
        }
        let err = Project::from_settings(&[("storage.efs", "fs-1"), (s.key, "not valid")])
            .err()
            .unwrap_or_else(|| panic!("{} took \"not valid\"", s.key))
            .to_string();
        assert!(
            err.starts_with(&format!("{} = \"not valid\" (from flag {})", s.key, s.flag)),
            "{err}"
        );
    }
    let err = Project::from_settings(&[("storage.efs", "fs-1"), ("job.rdzv_port", "0")])
        .unwrap_err()
        .to_string();
    assert!(err.ends_with("must be a port from 1 to 65535"), "{err}");
    for ok in ["none", "30"] {
        Project::from_settings(&[("storage.efs", "fs-1"), ("job.hang_timeout", ok)]).unwrap();
    }
}

/// A setting is one row: it names the field it writes, or it is one of the few that make a
/// field together with others (read in `Project::from_resolved`). A row with neither would
/// be a setting nothing reads: given, it would change nothing, silently.
#[test]
fn every_setting_is_read_into_the_project() {
    const READ_TOGETHER: [&str; 4] = [
        "storage.efs",
        "storage.fsx",
        "storage.host_path",
        "job.nnodes",
    ];
    for s in SETTINGS {
        assert_ne!(
            writes_a_field(s.key),
            READ_TOGETHER.contains(&s.key),
            "{}: a row names its field, or is read with others, not both",
            s.key
        );
    }
}
