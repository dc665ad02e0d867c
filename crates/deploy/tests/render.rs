//! Every rendered object: snapshot-tested (insta), and validated against the real schemas
//! (eksctl's JSON Schema; the PyTorchJob, TrainJob, TrainingRuntime and MPIJob CRDs'
//! openAPIV3Schema) copied into `schemas/`.

use std::path::PathBuf;
use std::sync::OnceLock;

use deploy::config::{Project, Renders};
use deploy::{eksctl, launchers, manifests};
use serde_json::Value;

fn project(flags: &[(&'static str, &str)]) -> Project {
    Project::from_settings(flags).unwrap_or_else(|e| panic!("{e}"))
}

fn schema_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("schemas")
}

fn eksctl_validator() -> &'static jsonschema::Validator {
    static V: OnceLock<jsonschema::Validator> = OnceLock::new();
    V.get_or_init(|| {
        let text =
            std::fs::read_to_string(schema_dir().join("eksctl-clusterconfig-v1alpha5.schema.json"))
                .unwrap();
        let mut schema: Value = serde_json::from_str(&text).unwrap();
        // eksctl's references name Go packages (`#/definitions/github.com|aws|...`); `|` is not
        // allowed in a URI, so it is percent-encoded (the pointer decodes it back).
        encode_refs(&mut schema);
        jsonschema::validator_for(&schema).unwrap()
    })
}

fn encode_refs(schema: &mut Value) {
    match schema {
        Value::Object(map) => {
            for (k, v) in map.iter_mut() {
                match v {
                    Value::String(r) if k == "$ref" => *r = r.replace('|', "%7C"),
                    v => encode_refs(v),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(encode_refs),
        _ => {}
    }
}

/// The API server prunes fields a structural schema does not name; refusing them instead
/// makes a misspelt or misplaced field fail here rather than vanish on apply.
fn close_objects(schema: &mut Value) {
    match schema {
        Value::Object(map) => {
            let open = map.contains_key("x-kubernetes-preserve-unknown-fields")
                || map.contains_key("additionalProperties");
            if map.contains_key("properties") && !open {
                map.insert("additionalProperties".into(), Value::Bool(false));
            }
            for v in map.values_mut() {
                close_objects(v);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(close_objects),
        _ => {}
    }
}

/// The schema of version `version` of the CRD in `file`, closed (see [`close_objects`]).
fn crd_validator(file: &str, version: &str) -> jsonschema::Validator {
    let text = std::fs::read_to_string(schema_dir().join(file)).unwrap();
    let crd: Value = serde_saphyr::from_str(&text).unwrap();
    let served = crd["spec"]["versions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == version)
        .unwrap_or_else(|| panic!("{file} serves {version}"));
    let mut schema = served["schema"]["openAPIV3Schema"].clone();
    close_objects(&mut schema);
    // metadata is `type: object` in the CRD; the API server checks it as ObjectMeta.
    jsonschema::validator_for(&schema).unwrap()
}

fn pytorchjob_validator() -> &'static jsonschema::Validator {
    static V: OnceLock<jsonschema::Validator> = OnceLock::new();
    V.get_or_init(|| crd_validator("kubeflow.org_pytorchjobs.yaml", "v1"))
}

fn trainjob_validator() -> &'static jsonschema::Validator {
    static V: OnceLock<jsonschema::Validator> = OnceLock::new();
    V.get_or_init(|| crd_validator("trainer.kubeflow.org_trainjobs.yaml", "v1alpha1"))
}

/// A `TrainingRuntime`'s schema: the `ClusterTrainingRuntime` CRD's, the same Go type.
fn runtime_validator() -> &'static jsonschema::Validator {
    static V: OnceLock<jsonschema::Validator> = OnceLock::new();
    V.get_or_init(|| {
        crd_validator(
            "trainer.kubeflow.org_clustertrainingruntimes.yaml",
            "v1alpha1",
        )
    })
}

fn mpijob_validator() -> &'static jsonschema::Validator {
    static V: OnceLock<jsonschema::Validator> = OnceLock::new();
    V.get_or_init(|| crd_validator("kubeflow.org_mpijobs-v2beta1.yaml", "v2beta1"))
}

fn assert_valid(validator: &jsonschema::Validator, doc: &Value, what: &str) {
    let errors: Vec<String> = validator
        .iter_errors(doc)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "{what} is invalid:\n{}",
        errors.join("\n")
    );
}

fn cluster_case(name: &str, flags: &[(&'static str, &str)]) {
    let doc = eksctl::cluster_config(&project(flags)).unwrap_or_else(|e| panic!("{e}"));
    assert_valid(eksctl_validator(), &doc, name);
    insta::assert_snapshot!(name, manifests::to_yaml(&[doc]));
}

#[test]
fn cluster_presets_render_valid_eksctl_configs() {
    cluster_case("cluster_cpu", &[]);
    cluster_case(
        "cluster_g4dn_new_vpc",
        &[
            ("cluster.preset", "g4dn"),
            ("cluster.availability_zones", "us-west-2b,us-west-2a"),
        ],
    );
    cluster_case(
        "cluster_g4dn_existing_vpc",
        &[
            ("cluster.preset", "g4dn"),
            ("cluster.existing_vpc", "vpc-0abc"),
            ("cluster.private_subnets", "subnet-0aaa,subnet-0bbb"),
            ("cluster.availability_zones", "us-west-2a,us-west-2b"),
        ],
    );
    cluster_case(
        "cluster_p4de_odcr_new_vpc",
        &[
            ("cluster.preset", "p4de-odcr"),
            ("cluster.region", "us-east-2"),
            ("cluster.capacity_reservation_id", "cr-0123456789abcdef0"),
            ("cluster.availability_zones", "us-east-2b,us-east-2a"),
        ],
    );
    cluster_case(
        "cluster_p4de_odcr_existing_vpc",
        &[
            ("cluster.preset", "p4de-odcr"),
            ("cluster.region", "us-east-2"),
            ("cluster.capacity_reservation_id", "cr-0123456789abcdef0"),
            ("cluster.existing_vpc", "vpc-0abc"),
            ("cluster.private_subnets", "subnet-0bbb,subnet-0aaa"),
            ("cluster.availability_zones", "us-east-2b,us-east-2a"),
        ],
    );
    cluster_case(
        "cluster_p5",
        &[
            ("cluster.preset", "p5"),
            ("cluster.availability_zones", "us-west-2c,us-west-2a"),
            ("cluster.nodes", "4"),
        ],
    );
}

#[test]
fn odcr_subnet_and_zone_match_the_reservation() {
    let p = project(&[
        ("cluster.preset", "p4de-odcr"),
        ("cluster.region", "us-east-2"),
        ("cluster.capacity_reservation_id", "cr-0123456789abcdef0"),
        ("cluster.existing_vpc", "vpc-0abc"),
        ("cluster.private_subnets", "subnet-0bbb,subnet-0aaa"),
        ("cluster.availability_zones", "us-east-2b,us-east-2a"),
    ]);
    let doc = eksctl::cluster_config(&p).unwrap();
    let workers = &doc["managedNodeGroups"][1];
    assert_eq!(workers["subnets"], serde_json::json!(["subnet-0bbb"]));
    assert_eq!(
        doc["vpc"]["subnets"]["private"]["us-east-2b"]["id"],
        "subnet-0bbb"
    );
    assert_eq!(
        workers["capacityReservation"]["capacityReservationTarget"]["capacityReservationID"],
        "cr-0123456789abcdef0"
    );
    assert_eq!(workers["efaEnabled"], true);
    assert_eq!(doc["iam"]["withOIDC"], true);
}

/// One zone for a new VPC (a reservation's zone, as `--az us-east-2b` says it): the control
/// plane gets a second zone, the workers stay in the one given.
#[test]
fn one_zone_for_a_new_vpc_keeps_the_workers_there() {
    for (preset, zone, extra) in [
        ("p4de-odcr", "us-east-2b", "us-east-2a"),
        ("cpu", "us-west-2a", "us-west-2b"),
    ] {
        let mut flags = vec![
            ("cluster.preset", preset),
            ("cluster.availability_zones", zone),
        ];
        if preset == "p4de-odcr" {
            flags.push(("cluster.region", "us-east-2"));
            flags.push(("cluster.capacity_reservation_id", "cr-0123456789abcdef0"));
        }
        let doc = eksctl::cluster_config(&project(&flags)).unwrap_or_else(|e| panic!("{e}"));
        assert_valid(eksctl_validator(), &doc, preset);
        assert_eq!(doc["availabilityZones"], serde_json::json!([zone, extra]));
        assert_eq!(
            doc["managedNodeGroups"][1]["availabilityZones"],
            serde_json::json!([zone]),
            "{preset}"
        );
    }
}

#[test]
fn presets_render_without_zones_in_the_regions_first_ones() {
    for preset in ["cpu", "g4dn", "p5"] {
        let p = project(&[("cluster.preset", preset), ("cluster.region", "eu-west-1")]);
        assert!(p.cluster.zones_picked);
        assert_eq!(p.cluster.availability_zones, ["eu-west-1a", "eu-west-1b"]);
        let doc = eksctl::cluster_config(&p).unwrap_or_else(|e| panic!("{preset}: {e}"));
        assert_valid(eksctl_validator(), &doc, preset);
        assert_eq!(
            doc["availabilityZones"],
            serde_json::json!(["eu-west-1a", "eu-west-1b"])
        );
    }
    let p = project(&[("cluster.region", "us-west-1")]);
    assert_eq!(p.cluster.availability_zones, ["us-west-1b", "us-west-1c"]);
    let given = project(&[("cluster.availability_zones", "us-west-2c,us-west-2d")]);
    assert!(!given.cluster.zones_picked);
    assert_eq!(
        given.cluster.availability_zones,
        ["us-west-2c", "us-west-2d"]
    );
}

#[test]
fn impossible_clusters_are_refused_with_what_to_do() {
    let refuse = |flags: &[(&'static str, &str)]| {
        eksctl::cluster_config(&project(flags))
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let e = refuse(&[("cluster.preset", "p4de-odcr")]);
    assert!(e.contains("--capacity-reservation-id"), "{e}");
    // An existing VPC's zones are its subnets': they are not picked for it.
    let e = refuse(&[
        ("cluster.preset", "g4dn"),
        ("cluster.existing_vpc", "vpc-1"),
        ("cluster.private_subnets", "subnet-1,subnet-2"),
    ]);
    assert!(e.contains("EFA, which needs one availability zone"), "{e}");
    let e = refuse(&[("cluster.availability_zones", "eu-west-1a,eu-west-1b")]);
    assert!(e.contains("not in region us-west-2"), "{e}");
    let e = refuse(&[
        ("cluster.existing_vpc", "vpc-1"),
        ("cluster.private_subnets", "subnet-1"),
        ("cluster.availability_zones", "us-west-2a,us-west-2b"),
    ]);
    assert!(
        e.contains("2 availability zones for 1 private subnets"),
        "{e}"
    );
    let e = refuse(&[("cluster.existing_vpc", "vpc-1")]);
    assert!(e.contains("--private-subnets"), "{e}");
}

#[test]
fn storage_renders_a_class_a_volume_and_a_read_write_many_claim() {
    let efs = manifests::storage(&project(&[("storage.efs", "fs-0123abcd")])).unwrap();
    insta::assert_snapshot!("storage_efs", manifests::to_yaml(&efs));
    let fsx = manifests::storage(&project(&[(
        "storage.fsx",
        "fs-0123abcd,fs-0123abcd.fsx.us-west-2.amazonaws.com,abcdefgh",
    )]))
    .unwrap();
    insta::assert_snapshot!("storage_fsx", manifests::to_yaml(&fsx));
    for docs in [&efs, &fsx] {
        let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            ["StorageClass", "PersistentVolume", "PersistentVolumeClaim"]
        );
        assert_eq!(docs[2]["spec"]["accessModes"][0], "ReadWriteMany");
        assert_eq!(docs[2]["spec"]["volumeName"], docs[1]["metadata"]["name"]);
        assert_eq!(
            docs[1]["spec"]["storageClassName"],
            docs[0]["metadata"]["name"]
        );
    }
    let e = manifests::storage(&project(&[])).unwrap_err().to_string();
    assert!(e.contains("--efs FS_ID"), "{e}");
}

#[test]
fn indexed_training_job() {
    let p = project(&[("storage.efs", "fs-1")]);
    let docs = launchers::training_job(&p, launchers::Token::Value("TOKEN"));
    insta::assert_snapshot!("job_indexed", manifests::to_yaml(&docs));
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["Secret", "Service", "Job"]);
    let job = &docs[2];
    assert_eq!(job["spec"]["completionMode"], "Indexed");
    assert_eq!(job["spec"]["completions"], 2);
    let pod = &job["spec"]["template"]["spec"];
    // Pod 0's stable name is NAME-0.NAME: the Service is the pods' subdomain.
    assert_eq!(pod["subdomain"], docs[1]["metadata"]["name"]);
    assert_eq!(docs[1]["spec"]["clusterIP"], "None");
    assert_eq!(docs[1]["spec"]["publishNotReadyAddresses"], true);
    let args: Vec<&str> = pod["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let joined = args.join(" ");
    assert!(
        joined.contains("--rdzv-endpoint cifar10-0.cifar10:29400"),
        "{joined}"
    );
    assert!(
        joined.contains(
            "train --data /data/cifar10 --out /data/runs --epochs 10 --batch-size 128 --lr 0.001"
        ),
        "{joined}"
    );
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        pod["nodeSelector"]["node.kubernetes.io/instance-type"],
        "c5.4xlarge"
    );
    let volumes = pod["volumes"].as_array().unwrap();
    assert!(volumes.iter().any(|v| v["emptyDir"]["medium"] == "Memory"));
    assert!(
        volumes
            .iter()
            .any(|v| v["persistentVolumeClaim"]["claimName"] == "trainctl-data")
    );
    assert!(job["spec"]["ttlSecondsAfterFinished"].as_i64().unwrap() > 0);
}

/// A job of one node is still Indexed: its pod is NAME-0 in the Service's subdomain, so the
/// rendezvous endpoint (and the doctor's peer) resolves, as it did not when a one-pod Job got a
/// random pod name.
#[test]
fn a_one_node_job_names_its_pod_like_the_endpoint() {
    let p = project(&[("storage.efs", "fs-1"), ("job.nnodes", "1")]);
    let docs = launchers::training_job(&p, launchers::Token::Value("TOKEN"));
    let job = docs.last().unwrap();
    assert_eq!(job["spec"]["completionMode"], "Indexed");
    assert_eq!(job["spec"]["completions"], 1);
    let pod = &job["spec"]["template"]["spec"];
    assert_eq!(pod["subdomain"], "cifar10");
    let args = pod["containers"][0]["args"].to_string();
    assert!(
        args.contains(r#""--rdzv-endpoint","cifar10-0.cifar10:29400""#),
        "{args}"
    );
    let doctor = manifests::doctor_job(&p);
    assert_eq!(doctor[1]["spec"]["completionMode"], "Indexed");
    assert_eq!(
        doctor[1]["spec"]["template"]["spec"]["subdomain"],
        "cifar10-doctor"
    );
}

/// What cannot get better on a retry fails the job at once: trainctl's own permanent codes and
/// a program that cannot run (126, 127: a missing binary or library); every container leaves
/// its last log lines as its termination message when it fails without writing one.
#[test]
fn permanent_exit_codes_fail_the_job_and_failures_keep_their_last_lines() {
    let p = project(&[("storage.efs", "fs-1")]);
    let mut jobs = launchers::training_job(&p, launchers::Token::Value("TOKEN"));
    jobs.push(manifests::data_job(&p, None));
    jobs.push(manifests::test_job(&p));
    jobs.extend(manifests::doctor_job(&p));
    for job in jobs.iter().filter(|d| d["kind"] == "Job") {
        let rules = job["spec"]["podFailurePolicy"]["rules"].as_array().unwrap();
        let fail = rules.iter().find(|r| r["action"] == "FailJob").unwrap();
        let codes = &fail["onExitCodes"]["values"];
        for code in [1, 2, 126, 127] {
            assert!(codes.as_array().unwrap().contains(&code.into()), "{codes}");
        }
        let container = &job["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(
            container["terminationMessagePolicy"], "FallbackToLogsOnError",
            "{}",
            job["metadata"]["name"]
        );
    }
}

/// What the Job controller does with a pod that ends (docs/KUBERNETES.md, "When a pod is
/// lost"): the podFailurePolicy's rules are tried in order and the first that matches decides.
/// An evicted or preempted pod (DisruptionTarget) and a pod whose `trainctl run` left the job
/// after a SIGTERM (exit 143, `contract::exit::PREEMPTED`) are replaced without counting a
/// failure; trainctl's permanent codes fail the job at once; anything else counts against the
/// job's budget of `max_restarts` failures per node: per index (`backoffLimitPerIndex`), so
/// that the controller delays a replacement by that index's failures alone rather than the
/// whole job's, with one index past its limit failing the job (`maxFailedIndexes: 0`), and
/// `backoffLimit` the whole job's limit where the server has no per-index one (before 1.29).
/// The replacement policy is the server's default, the only one it allows with a
/// podFailurePolicy: a pod is replaced once it has ended (Failed), never while it still
/// terminates.
#[test]
fn the_training_job_replaces_disrupted_and_departed_pods_without_counting() {
    use serde_json::json;
    for (flags, nodes) in [
        (&[("storage.efs", "fs-1")][..], 2),
        (
            &[
                ("storage.efs", "fs-1"),
                ("job.nnodes", "2:4"),
                ("job.rdzv_backend", "etcd"),
                ("job.max_restarts", "5"),
            ][..],
            4,
        ),
    ] {
        let p = project(flags);
        let docs = launchers::training_job(&p, launchers::Token::Value("TOKEN"));
        let job = docs.iter().find(|d| d["kind"] == "Job").unwrap();
        let spec = &job["spec"];
        let rules = spec["podFailurePolicy"]["rules"].as_array().unwrap();
        assert_eq!(rules.len(), 3, "{rules:#?}");
        assert_eq!(
            rules[0],
            json!({
                "action": "Ignore",
                "onPodConditions": [{ "type": "DisruptionTarget", "status": "True" }],
            })
        );
        assert_eq!(
            rules[1],
            json!({
                "action": "Ignore",
                "onExitCodes": {
                    "containerName": "pytorch", "operator": "In",
                    "values": [contract::exit::PREEMPTED],
                },
            })
        );
        assert_eq!(contract::exit::PREEMPTED, 143);
        assert_eq!(rules[2]["action"], "FailJob");
        assert_eq!(
            rules[2]["onExitCodes"]["values"],
            json!(contract::exit::PERMANENT)
        );
        assert!(!contract::exit::PERMANENT.contains(&contract::exit::PREEMPTED));
        // The rules name the training container; its pod is never restarted in place.
        let pod = &spec["template"]["spec"];
        assert_eq!(pod["containers"][0]["name"], "pytorch");
        assert_eq!(pod["restartPolicy"], "Never");
        let max_restarts: i64 = p.job.max_restarts.into();
        assert_eq!(spec["backoffLimit"], max_restarts * nodes, "{spec:#}");
        assert_eq!(spec["backoffLimitPerIndex"], max_restarts, "{spec:#}");
        assert_eq!(spec["maxFailedIndexes"], 0, "{spec:#}");
        assert_eq!(
            spec["completionMode"], "Indexed",
            "per-index limits need it"
        );
        let typed: k8s_openapi::api::batch::v1::Job =
            serde_json::from_value(job.clone().into()).unwrap();
        let typed = typed.spec.unwrap();
        assert_eq!(typed.backoff_limit_per_index, Some(max_restarts as i32));
        assert_eq!(typed.max_failed_indexes, Some(0));
        assert_eq!(spec["completions"], nodes);
        assert_eq!(spec["parallelism"], nodes);
        assert!(spec.get("podReplacementPolicy").is_none(), "{spec:#}");
    }
}

/// The pods serve `trainctl run --metrics-port` and say so to Prometheus; `--metrics-port 0`
/// takes flag, port and annotations away together.
#[test]
fn training_pods_announce_their_metrics_port() {
    let pod_of = |flags: &[(&'static str, &str)]| {
        let docs = launchers::training_job(&project(flags), launchers::Token::Value("TOKEN"));
        docs[2]["spec"]["template"].clone()
    };
    let pod = pod_of(&[("storage.efs", "fs-1"), ("job.metrics_port", "9100")]);
    let annotations = &pod["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/port"], "9100");
    assert_eq!(annotations["prometheus.io/path"], "/metrics");
    let container = &pod["spec"]["containers"][0];
    let args = container["args"].to_string();
    assert!(args.contains(r#""--metrics-port","9100""#), "{args}");
    assert!(
        container["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == "metrics" && p["containerPort"] == 9100)
    );

    let pod = pod_of(&[("storage.efs", "fs-1"), ("job.metrics_port", "0")]);
    assert!(pod["metadata"]["annotations"].is_null(), "{pod}");
    assert!(!pod.to_string().contains("--metrics-port"));
    assert_eq!(
        pod["spec"]["containers"][0]["ports"]
            .as_array()
            .unwrap()
            .len(),
        1
    );

    let err = Project::from_settings(&[("storage.efs", "fs-1"), ("job.metrics_port", "29400")])
        .unwrap_err()
        .to_string();
    assert!(err.contains("rendezvous port"), "{err}");
}

/// On a GPU instance the built-in trainer, which trains on CPUs only, takes none of the node's
/// GPUs or EFA adapters (they would sit idle, kept from every other pod) and says so, with how
/// to use them; its pods, and the doctor's, still tolerate the GPU nodes' taint, since they
/// are sent there. A program of the user's (`-- PROGRAM`) takes them all.
#[test]
fn gpu_nodes_give_their_gpus_to_a_program_not_to_the_built_in_trainer() {
    let flags = [
        ("cluster.preset", "g4dn"),
        ("storage.efs", "fs-1"),
        ("job.nproc_per_node", "8"),
    ];
    let p = project(&flags);
    let docs = launchers::training_job(&p, launchers::Token::Value("TOKEN"));
    let pod = &docs[2]["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    for resource in ["nvidia.com/gpu", manifests::EFA_RESOURCE] {
        assert!(
            container["resources"]["limits"][resource].is_null()
                && container["resources"]["requests"][resource].is_null(),
            "{container}"
        );
    }
    assert!(!container["env"].to_string().contains("FI_PROVIDER"));
    assert_eq!(pod["tolerations"][0]["key"], "nvidia.com/gpu");
    assert_eq!(
        pod["nodeSelector"]["node.kubernetes.io/instance-type"],
        "g4dn.metal"
    );
    let warnings = p.review(Renders::TrainingJob).unwrap();
    let idle = warnings
        .iter()
        .find(|w| w.contains("CPUs only"))
        .unwrap_or_else(|| panic!("{warnings:#?}"));
    assert!(
        idle.contains("g4dn.metal node's 8 GPUs or its EFA adapter")
            && idle.contains("trainctl job launch -- PROGRAM ARGS..."),
        "{idle}"
    );
    let doctor = manifests::doctor_job(&p);
    let doctor_pod = &doctor[1]["spec"]["template"]["spec"];
    assert_eq!(doctor_pod["tolerations"][0]["key"], "nvidia.com/gpu");
    assert_eq!(
        doctor_pod["nodeSelector"]["node.kubernetes.io/instance-type"],
        "g4dn.metal"
    );
    assert!(!doctor_pod.to_string().contains("--expect-gpus"));
    assert!(
        doctor_pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"].is_null(),
        "{doctor_pod}"
    );
    assert!(p.review(Renders::Doctor).unwrap().iter().any(|w| w == idle));
    insta::assert_snapshot!("job_indexed_g4dn", manifests::to_yaml(&docs));

    let p = project(&[flags.as_slice(), &[("job.command", "python train.py")]].concat());
    let docs = launchers::training_job(&p, launchers::Token::Value("TOKEN"));
    let pod = &docs[2]["spec"]["template"]["spec"];
    let resources = &pod["containers"][0]["resources"];
    for (resource, count) in [("nvidia.com/gpu", "8"), (manifests::EFA_RESOURCE, "1")] {
        assert_eq!(resources["limits"][resource], count, "{resources}");
        assert_eq!(resources["requests"][resource], count, "{resources}");
    }
    assert!(
        pod["containers"][0]["env"]
            .to_string()
            .contains("FI_PROVIDER")
    );
    assert_eq!(pod["tolerations"][0]["key"], "nvidia.com/gpu");
    let warnings = p.review(Renders::TrainingJob).unwrap();
    assert!(
        !warnings.iter().any(|w| w.contains("CPUs only")),
        "{warnings:#?}"
    );
}

#[test]
fn gpu_pods_on_efa_nodes_take_every_adapter_and_tell_nccl() {
    let pod_of = |instance: &str| {
        let p = project(&[
            ("storage.efs", "fs-1"),
            ("cluster.preset", "p5"),
            ("cluster.instance_type", instance),
            ("job.command", "python train.py"),
        ]);
        launchers::training_job(&p, launchers::Token::Value("TOKEN"))[2]["spec"]["template"]["spec"]
            ["containers"][0]
            .clone()
    };
    let env_of = |c: &serde_json::Value| -> Vec<(String, String)> {
        c["env"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| {
                Some((
                    e["name"].as_str()?.to_string(),
                    e["value"].as_str()?.to_string(),
                ))
            })
            .collect()
    };
    for (instance, adapters, rdma) in [
        ("p5.48xlarge", Some(32), true),
        ("p4de.24xlarge", Some(4), true),
        ("g4dn.metal", Some(1), false),
        ("g4dn.xlarge", None, false),
    ] {
        let c = pod_of(instance);
        let limit = &c["resources"]["limits"][manifests::EFA_RESOURCE];
        match adapters {
            Some(n) => {
                assert_eq!(limit, &serde_json::json!(n.to_string()), "{instance}: {c}");
                assert_eq!(c["resources"]["requests"][manifests::EFA_RESOURCE], *limit);
            }
            None => assert!(limit.is_null(), "{instance}: {c}"),
        }
        let env = env_of(&c);
        let has = |k: &str, v: &str| env.contains(&(k.to_string(), v.to_string()));
        assert_eq!(
            has("FI_PROVIDER", "efa"),
            adapters.is_some(),
            "{instance}: {env:?}"
        );
        assert_eq!(
            has("FI_EFA_USE_DEVICE_RDMA", "1"),
            rdma,
            "{instance}: {env:?}"
        );
    }
}

#[test]
fn a_queue_labels_the_training_job_for_kueue() {
    for launcher in ["indexed", "pytorchjob", "trainjob"] {
        let docs = launchers::training_job(
            &project(&[
                ("storage.efs", "fs-1"),
                ("job.launcher", launcher),
                ("job.queue", "team-a"),
            ]),
            launchers::Token::Value("TOKEN"),
        );
        let job = docs.last().unwrap();
        assert_eq!(
            job["metadata"]["labels"][manifests::QUEUE_LABEL],
            "team-a",
            "{launcher}: {job}"
        );
        if launcher == "pytorchjob" {
            assert_valid(pytorchjob_validator(), job, "queued PyTorchJob");
        }
        if launcher == "trainjob" {
            assert_valid(trainjob_validator(), job, "queued TrainJob");
        }
        let unqueued = launchers::training_job(
            &project(&[("storage.efs", "fs-1"), ("job.launcher", launcher)]),
            launchers::Token::Value("TOKEN"),
        );
        assert!(!manifests::to_yaml(&unqueued).contains(manifests::QUEUE_LABEL));
    }
    let err = Project::from_settings(&[("storage.efs", "fs-1"), ("job.queue", "Team A")])
        .unwrap_err()
        .to_string();
    assert!(err.contains("job.queue") && err.contains("Team A"), "{err}");
}

/// `--spares N`: the Indexed Job keeps N pods beyond `--nnodes` MAX (their agents wait warm
/// as spares, the pods' command line unchanged), and says how many for `job scale`; a launcher
/// whose operator keeps its own count of replicas refuses spares, saying what to use.
#[test]
fn spares_are_pods_beyond_max_of_an_indexed_job() {
    let docs = launchers::training_job(
        &project(&[
            ("storage.efs", "fs-1"),
            ("job.nnodes", "2:3"),
            ("job.spares", "1"),
        ]),
        launchers::Token::Value("TOKEN"),
    );
    let job = docs.last().unwrap();
    assert_eq!(job["spec"]["completions"], 4, "{job}");
    assert_eq!(job["spec"]["parallelism"], 4, "{job}");
    assert_eq!(job["metadata"]["annotations"]["trainctl.dev/spares"], "1");
    assert_eq!(job["metadata"]["annotations"]["trainctl.dev/nnodes"], "2:3");
    let args = job["spec"]["template"]["spec"]["containers"][0]["args"].to_string();
    assert!(
        args.contains("\"2:3\""),
        "the agents' bounds stay MIN:MAX: {args}"
    );
    let err = Project::from_settings(&[
        ("storage.efs", "fs-1"),
        ("job.launcher", "pytorchjob"),
        ("job.spares", "1"),
    ])
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("job.spares") && err.contains("use --launcher indexed"),
        "{err}"
    );
}

#[test]
fn pytorchjobs_validate_against_the_crd() {
    for (name, nnodes) in [("job_pytorchjob", "2"), ("job_pytorchjob_elastic", "1:3")] {
        let p = project(&[
            ("storage.efs", "fs-1"),
            ("job.launcher", "pytorchjob"),
            ("job.nnodes", nnodes),
        ]);
        let docs = launchers::training_job(&p, launchers::Token::Value("TOKEN"));
        assert_eq!(docs[1]["kind"], "PyTorchJob");
        assert_valid(pytorchjob_validator(), &docs[1], name);
        insta::assert_snapshot!(name, manifests::to_yaml(&docs));
        let spec = &docs[1]["spec"];
        let worker = &spec["pytorchReplicaSpecs"]["Worker"];
        assert_eq!(
            worker["template"]["spec"]["containers"][0]["name"],
            "pytorch"
        );
        assert_eq!(
            worker["template"]["spec"]["containers"][0]["ports"][0]["name"],
            "pytorchjob-port"
        );
        if nnodes == "1:3" {
            assert_eq!(spec["elasticPolicy"]["minReplicas"], 1);
            assert_eq!(spec["elasticPolicy"]["maxReplicas"], 3);
            assert_eq!(worker["replicas"], 3);
        } else {
            assert!(spec.get("elasticPolicy").is_none());
        }
    }
}

/// `--launcher trainjob`: a TrainingRuntime of the job's own (the Indexed Job's pods, as a
/// JobSet's replicated job "node") and a TrainJob referencing it, both valid against Trainer
/// v2's CRDs; pod 0's DNS name is JobSet's.
#[test]
fn trainjobs_validate_against_trainers_crds() {
    for (name, flags) in [
        ("job_trainjob_elastic", &[("job.nnodes", "1:3")][..]),
        (
            "job_trainjob_user_program_etcd",
            &[
                ("job.nnodes", "2"),
                ("job.command", "python train.py --epochs 3"),
                ("job.rdzv_backend", "etcd"),
                ("job.queue", "team-a"),
                ("image", "python:3.12-slim"),
                ("trainctl_image", "registry.example/trainctl:1"),
            ][..],
        ),
    ] {
        let mut settings = vec![("storage.efs", "fs-1"), ("job.launcher", "trainjob")];
        settings.extend_from_slice(flags);
        let p = project(&settings);
        let docs = launchers::training_job(&p, launchers::Token::Value("TOKEN"));
        let kinds: Vec<&str> = docs.iter().map(|d| d.kind()).collect();
        let runtime = &docs[docs.len() - 2];
        let job = &docs[docs.len() - 1];
        assert_eq!(
            kinds[kinds.len() - 2..],
            ["TrainingRuntime", "TrainJob"],
            "{name}"
        );
        assert_valid(runtime_validator(), runtime, name);
        assert_valid(trainjob_validator(), job, name);
        insta::assert_snapshot!(name, manifests::to_yaml(&docs));
        assert_eq!(
            job["spec"]["runtimeRef"]["name"],
            runtime["metadata"]["name"]
        );
        assert_eq!(job["spec"]["runtimeRef"]["kind"], "TrainingRuntime");
        let node = &runtime["spec"]["template"]["spec"]["replicatedJobs"][0];
        assert_eq!(node["name"], "node");
        let pod = &node["template"]["spec"]["template"]["spec"];
        assert_eq!(pod["containers"][0]["name"], "node");
        let args = pod["containers"][0]["args"].as_array().unwrap();
        let endpoint = args
            .iter()
            .position(|a| a == "--rdzv-endpoint")
            .map(|i| args[i + 1].as_str().unwrap());
        if name.contains("etcd") {
            assert_eq!(endpoint, Some("cifar10-etcd:2379"));
            assert_eq!(job["metadata"]["labels"][manifests::QUEUE_LABEL], "team-a");
            // The program's image lacks trainctl: an init container brings it.
            assert_eq!(pod["initContainers"][0]["name"], "install-trainctl");
        } else {
            assert_eq!(endpoint, Some("cifar10-node-0-0.cifar10:29400"));
            assert_eq!(launchers::rdzv_host(&p), "cifar10-node-0-0.cifar10");
            assert!(args.iter().any(|a| a == "1:3"), "{args:?}");
        }
    }
}

/// `--launcher mpijob`: mpirun on a launcher created once the workers are ready, sshd on the
/// workers, as MPI Operator's v2beta1 CRD takes it; no token, no rendezvous.
#[test]
fn mpijobs_validate_against_the_mpi_operators_crd() {
    let p = project(&[
        ("storage.efs", "fs-1"),
        ("job.launcher", "mpijob"),
        ("job.nnodes", "2"),
        ("job.nproc_per_node", "4"),
        ("job.command", "python train.py"),
        ("job.mpi_implementation", "intel"),
        ("image", "mpioperator/openmpi:v0.6.0"),
    ]);
    let docs = launchers::training_job(&p, launchers::Token::Value("TOKEN"));
    assert_eq!(docs.len(), 1, "no Secret, no etcd: {docs:?}");
    let job = &docs[0];
    assert_eq!(job.kind(), "MPIJob");
    assert_valid(mpijob_validator(), job, "job_mpijob");
    insta::assert_snapshot!("job_mpijob", manifests::to_yaml(&docs));
    let spec = &job["spec"];
    assert_eq!(spec["launcherCreationPolicy"], "WaitForWorkersReady");
    assert_eq!(spec["mpiImplementation"], "Intel");
    assert_eq!(spec["slotsPerWorker"], 4);
    let launcher = &spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0];
    assert_eq!(launcher["command"][0], "mpirun");
    assert_eq!(
        launcher["args"],
        serde_json::json!(["-np", "8", "python", "train.py"])
    );
    let workers = &spec["mpiReplicaSpecs"]["Worker"];
    assert_eq!(workers["replicas"], 2);
    let worker = &workers["template"]["spec"]["containers"][0];
    assert_eq!(worker["command"][0], "/usr/sbin/sshd");
    // ssh finds its keys in the image user's home: HOME is not moved to /tmp here.
    assert!(!worker["env"].to_string().contains("HOME"), "{worker}");
    assert!(workers["template"]["spec"]["initContainers"].is_null());
    // Invalid values are caught by the schema too.
    let mut bad = job.clone();
    bad["spec"]["mpiImplementation"] = "OpenMPI5".into();
    assert!(!mpijob_validator().is_valid(&bad));
}

/// The MPIJob launcher refuses to render what it cannot run, naming the setting and the way
/// out (other commands, `cluster addons` among them, take the setting as it is).
#[test]
fn an_mpijob_refuses_the_built_in_trainer_and_an_elastic_size() {
    let refused = |settings: &[(&'static str, &str)]| {
        Project::from_settings(settings)
            .and_then(|p| p.review(Renders::TrainingJob))
            .unwrap_err()
            .to_string()
    };
    let err = refused(&[("storage.efs", "fs-1"), ("job.launcher", "mpijob")]);
    assert!(
        err.starts_with("job.launcher = \"mpijob\" (from flag --launcher)")
            && err.contains("-- PROGRAM")
            && err.contains("trainjob"),
        "{err}"
    );
    let err = refused(&[
        ("storage.efs", "fs-1"),
        ("job.launcher", "mpijob"),
        ("job.command", "python train.py"),
        ("job.nnodes", "1:3"),
    ]);
    assert!(
        err.contains("not elastic") && err.contains("--nnodes 3"),
        "{err}"
    );
    let p = project(&[("storage.efs", "fs-1"), ("job.launcher", "mpijob")]);
    assert!(p.review(Renders::Doctor).is_ok());
    let err = Project::from_settings(&[("storage.efs", "fs-1"), ("job.launcher", "slurm")])
        .unwrap_err()
        .to_string();
    for kind in deploy::launchers::KINDS {
        assert!(err.contains(kind.name()), "{err}");
    }
}

#[test]
fn the_crd_check_catches_a_misplaced_field() {
    let p = project(&[("storage.efs", "fs-1"), ("job.launcher", "pytorchjob")]);
    let mut job = launchers::training_job(&p, launchers::Token::Value("TOKEN")).remove(1);
    job["spec"]["elasticPolicy"] = serde_json::json!({ "minReplica": 1 });
    assert!(!pytorchjob_validator().is_valid(&job));
    job["spec"]["elasticPolicy"] = serde_json::json!({ "minReplicas": "one" });
    assert!(!pytorchjob_validator().is_valid(&job));
}

#[test]
fn data_test_and_doctor_jobs() {
    let p = project(&[("storage.efs", "fs-1")]);
    let data = manifests::data_job(&p, None);
    let synthetic = manifests::data_job(&p, Some(256));
    assert_eq!(
        synthetic["spec"]["template"]["spec"]["containers"][0]["args"][1],
        "synth"
    );
    insta::assert_snapshot!("job_data", manifests::to_yaml(std::slice::from_ref(&data)));
    let test = manifests::test_job(&p);
    insta::assert_snapshot!("job_test", manifests::to_yaml(std::slice::from_ref(&test)));
    let doctor = manifests::doctor_job(&p);
    insta::assert_snapshot!("job_doctor", manifests::to_yaml(&doctor));
    let data_args = &data["spec"]["template"]["spec"]["containers"][0]["args"];
    assert_eq!(
        (&data_args[0], &data_args[1]),
        (&Value::from("data"), &Value::from("fetch"))
    );
    let test_args = &test["spec"]["template"]["spec"]["containers"][0]["args"];
    assert_eq!(test_args[2], "/data/runs/cifar10/model.safetensors");
    // Helper jobs do not need the training nodes' size or GPUs.
    assert!(
        data["spec"]["template"]["spec"]
            .get("nodeSelector")
            .is_none()
    );
    // Each helper's container is named after what it does, and its Job's failure policy
    // reads that container's exit codes; only the training container is `pytorch`.
    let doctor_job = doctor.iter().find(|d| d["kind"] == "Job").unwrap();
    for (job, name) in [(&data, "data"), (&test, "test"), (doctor_job, "doctor")] {
        let spec = &job["spec"];
        assert_eq!(spec["template"]["spec"]["containers"][0]["name"], name);
        for rule in spec["podFailurePolicy"]["rules"].as_array().unwrap() {
            if let Some(codes) = rule.get("onExitCodes") {
                assert_eq!(codes["containerName"], name, "{rule}");
            }
        }
    }
}

/// tiny-imagenet and a ResNet: the data job fetches the other archive into its own folder,
/// and the training pods train the chosen network on it.
#[test]
fn a_resnet_on_tiny_imagenet() {
    let p = project(&[
        ("storage.efs", "fs-1"),
        ("data.dataset", "tiny-imagenet"),
        ("job.model", "resnet50"),
    ]);
    let args = |doc: &Value| -> Vec<String> {
        doc["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .collect()
    };
    let data = args(&manifests::data_job(&p, None));
    assert_eq!(
        data,
        [
            "data",
            "fetch",
            "--dataset",
            "tiny-imagenet",
            "--data",
            "/data/tiny-imagenet",
            "--download-url",
            "http://cs231n.stanford.edu/tiny-imagenet-200.zip",
            "--download-md5",
            "90528d7ca1a48142e341f4ef8d21d0de",
        ]
    );
    let docs = launchers::training_job(&p, launchers::Token::Value("token"));
    let job = docs.iter().find(|d| d["kind"] == "Job").unwrap();
    let train = args(job).join(" ");
    assert!(
        train.contains("train --model resnet50 --data /data/tiny-imagenet "),
        "{train}"
    );
    for (key, value) in [("job.model", "resnet7"), ("data.dataset", "imagenet")] {
        let err = Project::from_settings(&[(key, value)])
            .unwrap_err()
            .to_string();
        assert!(err.contains(key) && err.contains(value), "{err}");
    }
}

#[test]
fn device_plugin() {
    insta::assert_snapshot!(
        "nvidia_device_plugin",
        manifests::to_yaml(&[manifests::nvidia_device_plugin()])
    );
}

#[test]
fn core_objects_read_back_as_their_k8s_openapi_types() {
    // What we render deserialises into the API's types without loss of kind or name.
    use k8s_openapi::api::batch::v1::Job;
    use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Service};
    let p = project(&[("storage.efs", "fs-1")]);
    let docs = launchers::training_job(&p, launchers::Token::Value("TOKEN"));
    let service: Service = serde_json::from_value(docs[1].clone().into()).unwrap();
    let job: Job = serde_json::from_value(docs[2].clone().into()).unwrap();
    assert_eq!(service.metadata.name.as_deref(), Some("cifar10"));
    assert_eq!(job.spec.unwrap().parallelism, Some(2));
    let storage = manifests::storage(&p).unwrap();
    let claim: PersistentVolumeClaim = serde_json::from_value(storage[2].clone().into()).unwrap();
    assert_eq!(claim.metadata.namespace.as_deref(), Some("default"));
}

#[test]
fn every_object_carries_the_resource_it_is_served_at() {
    // The kind travels with the object: what apply and delete use is what the document says,
    // and a namespaced resource is exactly one rendered with a namespace.
    let p = project(&[("storage.efs", "fs-1"), ("job.rdzv_backend", "etcd")]);
    let pytorchjob = project(&[("job.launcher", "pytorchjob")]);
    let mut all = launchers::training_job(&p, launchers::Token::Value("TOKEN"));
    all.extend(launchers::training_job(
        &pytorchjob,
        launchers::Token::Value("TOKEN"),
    ));
    all.extend(manifests::storage(&p).unwrap());
    all.extend(manifests::doctor_job(&p));
    all.extend(manifests::tensorboard(&p));
    all.push(manifests::data_job(&p, None));
    all.push(manifests::test_job(&p));
    all.push(launchers::token_secret(
        &p,
        launchers::Token::Value("TOKEN"),
    ));
    all.push(manifests::nvidia_device_plugin());
    let mut kinds = std::collections::BTreeSet::new();
    for m in &all {
        let r = m.resource();
        assert_eq!(m["apiVersion"], r.api_version.as_str(), "{m}");
        assert_eq!(m["kind"], r.kind.as_str(), "{m}");
        assert_eq!(
            m.namespaced(),
            m["metadata"]["namespace"].is_string(),
            "{m}"
        );
        assert!(
            r.plural.ends_with('s') && r.plural == r.plural.to_lowercase(),
            "{m}"
        );
        kinds.insert(r.kind.clone());
    }
    let expected = [
        "DaemonSet",
        "Deployment",
        "Job",
        "PersistentVolume",
        "PersistentVolumeClaim",
        "PyTorchJob",
        "Secret",
        "Service",
        "StorageClass",
    ];
    assert_eq!(kinds.into_iter().collect::<Vec<_>>(), expected);
}

#[test]
fn the_eksctl_check_catches_a_misspelt_field() {
    let mut doc = eksctl::cluster_config(&project(&[])).unwrap();
    assert!(eksctl_validator().is_valid(&doc));
    doc["managedNodeGroups"][1]["instancetype"] = Value::from("c5.4xlarge");
    assert!(!eksctl_validator().is_valid(&doc));
    doc["managedNodeGroups"][1]
        .as_object_mut()
        .unwrap()
        .remove("instancetype");
    doc["managedNodeGroups"][1]["desiredCapacity"] = Value::from("two");
    assert!(!eksctl_validator().is_valid(&doc));
}

/// The CPU DDP seed (a gloo script in the user's PyTorch image) as the job's program, for both
/// launchers: every pod runs `trainctl run <rendezvous flags> -- python ...` from the binary an
/// init container copied out of trainctl's image.
#[test]
fn a_user_program_in_its_own_image_runs_under_trainctl_run() {
    for (launcher, nnodes) in [("indexed", "2"), ("pytorchjob", "2"), ("pytorchjob", "1:3")] {
        let p = project(&[
            ("storage.efs", "fs-1"),
            ("job.launcher", launcher),
            ("job.nnodes", nnodes),
            ("image", "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"),
            (
                "trainctl_image",
                "123456789012.dkr.ecr.us-west-2.amazonaws.com/trainctl:0.1",
            ),
            (
                "job.command",
                "python /data/code/ddp_gloo.py --epochs 2 --note 'two words'",
            ),
        ]);
        let docs = launchers::training_job(&p, launchers::Token::Value("TOKEN"));
        let job = docs.last().unwrap();
        let pod = if launcher == "indexed" {
            &job["spec"]["template"]["spec"]
        } else {
            assert_valid(pytorchjob_validator(), job, "user-program PyTorchJob");
            &job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        };
        if nnodes == "2" {
            insta::assert_snapshot!(
                format!("job_{launcher}_user_program"),
                manifests::to_yaml(&docs)
            );
        }
        let c = &pod["containers"][0];
        assert_eq!(c["image"], "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime");
        assert_eq!(c["command"], serde_json::json!(["/opt/trainctl/trainctl"]));
        let args: Vec<&str> = c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert_eq!(args[0], "run");
        let dashes = args.iter().position(|a| *a == "--").unwrap();
        assert_eq!(
            args[dashes + 1..],
            [
                "python",
                "/data/code/ddp_gloo.py",
                "--epochs",
                "2",
                "--note",
                "two words"
            ]
        );
        assert!(!args.contains(&"train"), "{args:?}");
        if launcher == "indexed" || nnodes == "2" {
            let flags = args[..dashes].join(" ");
            assert!(flags.contains("--rdzv-backend c10d"), "{flags}");
        }
        // The image's own working directory; a writable root; a home the pod's user can use.
        assert!(c.get("workingDir").is_none(), "{c}");
        assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], false);
        assert!(
            c["env"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["name"] == "HOME" && e["value"] == "/tmp")
        );
        // The init container copies trainctl into the emptyDir the container runs it from.
        let init = &pod["initContainers"][0];
        assert_eq!(init["name"], manifests::INSTALL_CONTAINER);
        assert_eq!(
            init["image"],
            "123456789012.dkr.ecr.us-west-2.amazonaws.com/trainctl:0.1"
        );
        assert_eq!(
            init["args"],
            serde_json::json!(["install", manifests::BINARY_DIR])
        );
        let mount = |c: &Value| {
            c["volumeMounts"]
                .as_array()
                .unwrap()
                .iter()
                .find(|m| m["mountPath"] == manifests::BINARY_DIR)
                .cloned()
                .unwrap_or_else(|| panic!("no {} mount in {c}", manifests::BINARY_DIR))
        };
        assert_eq!(mount(init)["name"], mount(c)["name"]);
        assert_eq!(mount(c)["readOnly"], true);
    }
}

/// An image with trainctl in it (baked in, docs/KUBERNETES.md) needs no init container; an
/// image that runs a program without saying where trainctl is from is refused with what to do.
#[test]
fn trainctl_comes_from_the_image_or_an_init_container() {
    let p = project(&[
        ("storage.efs", "fs-1"),
        ("image", "me/pytorch-and-trainctl:1"),
        ("trainctl_image", "me/pytorch-and-trainctl:1"),
        ("job.command", "python main.py"),
    ]);
    let job = launchers::training_job(&p, launchers::Token::Value("TOKEN"))
        .pop()
        .unwrap();
    let pod = &job["spec"]["template"]["spec"];
    assert!(pod.get("initContainers").is_none(), "{pod}");
    assert_eq!(
        pod["containers"][0]["command"],
        serde_json::json!(["trainctl"])
    );
    // Helper jobs run trainctl's image, whatever the training pods run.
    let p = project(&[
        ("storage.efs", "fs-1"),
        ("image", "pytorch/pytorch:2.5.1"),
        ("trainctl_image", "ecr/trainctl:0.1"),
        ("job.command", "python main.py"),
    ]);
    for helper in [
        manifests::data_job(&p, None),
        manifests::test_job(&p),
        manifests::doctor_job(&p).pop().unwrap(),
    ] {
        let pod = &helper["spec"]["template"]["spec"];
        assert_eq!(pod["containers"][0]["image"], "ecr/trainctl:0.1");
        assert!(pod.get("initContainers").is_none(), "{pod}");
    }
    let e = Project::from_settings(&[
        ("image", "pytorch/pytorch:2.5.1"),
        ("job.command", "python main.py"),
    ])
    .unwrap_err()
    .to_string();
    assert!(e.contains("--trainctl-image"), "{e}");
    assert!(e.contains("python main.py"), "{e}");
    let e = Project::from_settings(&[("job.command", "python 'main.py")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("a quote is not closed"), "{e}");
}

/// `--rdzv-backend etcd`: an etcd (Service + Deployment) beside the job and every pod's
/// `trainctl run` pointed at it, for both launchers; the PyTorchJob's elasticPolicy names it
/// too. Its data lives in an emptyDir, or on the claim when asked.
#[test]
fn etcd_rendezvous_renders_an_etcd_beside_the_job() {
    for (launcher, nnodes) in [("indexed", "2"), ("pytorchjob", "1:3")] {
        let p = project(&[
            ("storage.efs", "fs-1"),
            ("job.launcher", launcher),
            ("job.nnodes", nnodes),
            ("job.rdzv_backend", "etcd"),
        ]);
        let docs = launchers::training_job(&p, launchers::Token::Value("TOKEN"));
        let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
        let job = docs.last().unwrap();
        let pod = if launcher == "indexed" {
            assert_eq!(kinds, ["Secret", "Service", "Deployment", "Service", "Job"]);
            insta::assert_snapshot!("job_indexed_etcd", manifests::to_yaml(&docs));
            &job["spec"]["template"]["spec"]
        } else {
            assert_eq!(kinds, ["Secret", "Service", "Deployment", "PyTorchJob"]);
            assert_valid(pytorchjob_validator(), job, "etcd PyTorchJob");
            let policy = &job["spec"]["elasticPolicy"];
            assert_eq!(policy["rdzvBackend"], "etcd");
            assert_eq!(policy["rdzvHost"], "cifar10-etcd");
            assert_eq!(policy["rdzvPort"], 2379);
            &job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        };
        let args = pod["containers"][0]["args"].to_string();
        assert!(
            args.contains(r#""--rdzv-backend","etcd","--rdzv-endpoint","cifar10-etcd:2379""#),
            "{args}"
        );
        // The etcd's Service selects its Deployment's pods, on the port the pods are told.
        use k8s_openapi::api::apps::v1::Deployment;
        use k8s_openapi::api::core::v1::Service;
        let service: Service = serde_json::from_value(docs[1].clone().into()).unwrap();
        let deployment: Deployment = serde_json::from_value(docs[2].clone().into()).unwrap();
        let spec = deployment.spec.unwrap();
        assert_eq!(spec.replicas, Some(1));
        assert_eq!(
            service.spec.as_ref().unwrap().selector,
            spec.template.metadata.unwrap().labels
        );
        assert_eq!(service.metadata.name.as_deref(), Some("cifar10-etcd"));
        assert_eq!(
            service.spec.unwrap().ports.unwrap()[0].port,
            i32::from(manifests::ETCD_PORT)
        );
        let etcd = &spec.template.spec.unwrap().containers[0];
        let etcd_args = etcd.args.clone().unwrap().join(" ");
        assert!(
            etcd_args.contains("--advertise-client-urls http://cifar10-etcd:2379"),
            "{etcd_args}"
        );
        assert!(
            etcd_args.contains("--data-dir /var/lib/etcd/data"),
            "{etcd_args}"
        );
    }
    let on_claim = manifests::etcd(&project(&[
        ("storage.efs", "fs-1"),
        ("job.rdzv_backend", "etcd"),
        ("job.etcd_storage", "claim"),
    ]));
    let pod = &on_claim[1]["spec"]["template"]["spec"];
    assert_eq!(
        pod["volumes"][0]["persistentVolumeClaim"]["claimName"],
        "trainctl-data"
    );
    assert!(
        pod["containers"][0]["args"]
            .to_string()
            .contains("/var/lib/etcd/.etcd/cifar10-etcd"),
        "{pod}"
    );
    let e = Project::from_settings(&[("job.rdzv_backend", "zookeeper")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("choose c10d") && e.contains("zookeeper"), "{e}");
    // The default stays c10d: no etcd.
    let docs = launchers::training_job(
        &project(&[("storage.efs", "fs-1")]),
        launchers::Token::Value("TOKEN"),
    );
    assert!(docs.iter().all(|d| d["kind"] != "Deployment"));
}

/// TensorBoard reads the runs folder from a read-only mount of the claim.
#[test]
fn tensorboard_serves_the_runs_folder_read_only() {
    let p = project(&[("storage.efs", "fs-1")]);
    let docs = manifests::tensorboard(&p);
    insta::assert_snapshot!("tensorboard", manifests::to_yaml(&docs));
    use k8s_openapi::api::apps::v1::Deployment;
    let deployment: Deployment = serde_json::from_value(docs[1].clone().into()).unwrap();
    let pod = deployment.spec.unwrap().template.spec.unwrap();
    let c = &pod.containers[0];
    assert_eq!(
        c.args.clone().unwrap()[..2],
        ["--logdir".to_string(), "/data/runs".to_string()]
    );
    let data = c
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.mount_path == "/data")
        .unwrap();
    assert_eq!(data.read_only, Some(true));
    let claim = pod.volumes.unwrap()[0]
        .persistent_volume_claim
        .clone()
        .unwrap();
    assert_eq!(claim.read_only, Some(true));
    assert_eq!(docs[0]["spec"]["ports"][0]["port"], 6006);
}

/// The doctor's pods take the GPUs and EFA adapters a training pod takes, and are told how
/// many to expect; with the built-in trainer (CPU only), none.
#[test]
fn the_doctor_checks_the_accelerators_a_training_pod_gets() {
    let builtin = manifests::doctor_job(&project(&[
        ("storage.efs", "fs-1"),
        ("cluster.preset", "p5"),
    ]));
    assert!(!builtin[1].to_string().contains("--expect-gpus"));
    let p = project(&[
        ("storage.efs", "fs-1"),
        ("cluster.preset", "p5"),
        ("job.command", "python train.py"),
    ]);
    let doctor = manifests::doctor_job(&p).pop().unwrap();
    let c = &doctor["spec"]["template"]["spec"]["containers"][0];
    let args = c["args"].to_string();
    assert!(args.contains(r#""--expect-gpus","8""#), "{args}");
    assert!(args.contains(r#""--expect-efa","32""#), "{args}");
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "8");
    assert_eq!(c["resources"]["limits"][manifests::EFA_RESOURCE], "32");
    let cpu = manifests::doctor_job(&project(&[("storage.efs", "fs-1")]))
        .pop()
        .unwrap();
    assert!(!cpu.to_string().contains("--expect-gpus"));
}

/// `cluster.s3_bucket`: eksctl creates an IRSA service account allowed that bucket alone; the
/// training, data and test pods run under it, the data job stages from S3 (`data.from`), the
/// trainer uploads its results, and a user program's code is fetched first (`job.fetch`).
#[test]
fn an_s3_bucket_gives_the_pods_an_irsa_service_account() {
    let bucket = [("cluster.s3_bucket", "my-training-bucket")];
    cluster_case("cluster_cpu_s3", &bucket);
    let doc = eksctl::cluster_config(&project(&bucket)).unwrap();
    assert_eq!(doc["iam"]["withOIDC"], true);
    let account = &doc["iam"]["serviceAccounts"][0];
    assert_eq!(account["metadata"]["name"], "trainctl-s3");
    assert_eq!(account["metadata"]["namespace"], "default");
    let resources: Vec<&str> = account["attachPolicy"]["Statement"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["Resource"].as_str().unwrap())
        .collect();
    assert_eq!(
        resources,
        [
            "arn:aws:s3:::my-training-bucket",
            "arn:aws:s3:::my-training-bucket/*"
        ]
    );

    let p = project(&[
        ("storage.efs", "fs-1"),
        ("cluster.s3_bucket", "my-training-bucket"),
        ("data.from", "s3://my-training-bucket/datasets/cifar10"),
    ]);
    let pod = |doc: &Value| doc["spec"]["template"]["spec"].clone();
    let args = |pod: &Value| -> Vec<String> {
        pod["containers"][0]["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .collect()
    };
    let data = manifests::data_job(&p, None);
    insta::assert_snapshot!(
        "job_data_s3",
        manifests::to_yaml(std::slice::from_ref(&data))
    );
    assert_eq!(
        args(&pod(&data)),
        [
            "data",
            "stage",
            "s3://my-training-bucket/datasets/cifar10",
            "/data/cifar10"
        ]
    );
    let docs = launchers::training_job(&p, launchers::Token::Value("token"));
    let job = docs.iter().find(|d| d["kind"] == "Job").unwrap();
    let train = args(&pod(job)).join(" ");
    assert!(
        train.ends_with("--upload s3://my-training-bucket/runs/cifar10"),
        "{train}"
    );
    for doc in [&data, job, &manifests::test_job(&p)] {
        assert_eq!(pod(doc)["serviceAccountName"], "trainctl-s3");
    }
    for doc in manifests::doctor_job(&p) {
        if doc["kind"] == "Job" {
            assert!(pod(&doc).get("serviceAccountName").is_none());
        }
    }

    // A user program fetched from S3, as the torchelastic example downloads its main.py.
    let p = project(&[
        ("storage.efs", "fs-1"),
        ("cluster.s3_bucket", "my-training-bucket"),
        ("job.launcher", "pytorchjob"),
        ("image", "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"),
        ("trainctl_image", "trainctl:0.1"),
        ("job.command", "python main.py --epochs 2"),
        (
            "job.fetch",
            "s3://my-training-bucket/code/main.py s3://my-training-bucket/code/lib/",
        ),
        ("job.upload", "none"),
    ]);
    let docs = launchers::training_job(&p, launchers::Token::Value("TOKEN"));
    let job = docs.last().unwrap();
    assert_valid(
        pytorchjob_validator(),
        job,
        "PyTorchJob fetching its program",
    );
    insta::assert_snapshot!("job_pytorchjob_fetch", manifests::to_yaml(&docs));
    let worker = &job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"];
    assert_eq!(worker["serviceAccountName"], "trainctl-s3");
    let run = args(worker).join(" ");
    assert!(
        run.contains(
            "--fetch s3://my-training-bucket/code/main.py --fetch s3://my-training-bucket/code/lib/ \
             --fetch-dir /tmp/code -- python main.py --epochs 2"
        ),
        "{run}"
    );
    assert!(!run.contains("--upload"), "{run}");

    for (settings, says) in [
        (vec![("cluster.s3_bucket", "My_Bucket")], "'M'"),
        (vec![("data.from", "https://example.com/data")], "s3://"),
        (vec![("job.fetch", "s3://b/main.py")], "3 to 63"),
        (
            vec![("job.fetch", "s3://bucket/main.py")],
            "no program is set",
        ),
    ] {
        let err = Project::from_settings(&settings).unwrap_err().to_string();
        assert!(err.contains(settings[0].0) && err.contains(says), "{err}");
    }
}

/// `job render` shows the token Secret without its value: the YAML is the same on every render
/// of the job (so `kubectl diff` sees no change) and prints no secret. `job launch` writes its
/// random token into the same Secret, and nothing else differs.
#[test]
fn the_token_secret_is_the_same_on_every_render_and_holds_no_token() {
    let p = project(&[("storage.efs", "fs-1")]);
    let render = || launchers::training_job(&p, launchers::Token::Withheld);
    let first = render();
    assert_eq!(manifests::to_yaml(&first), manifests::to_yaml(&render()));
    let secret = &first[0];
    assert_eq!(secret["kind"], "Secret");
    assert!(
        secret.get("stringData").is_none() && secret.get("data").is_none(),
        "{secret}"
    );
    let launched = launchers::training_job(&p, launchers::Token::Value("s3cret-from-launch"));
    assert_eq!(launched[0]["stringData"]["token"], "s3cret-from-launch");
    let mut without_value = launched[0].clone();
    without_value.as_object_mut().unwrap().remove("stringData");
    assert_eq!(without_value, first[0]);
    assert_eq!(launched[1..], first[1..]);
    // The pods read the token from that Secret, which must have it.
    let env = first[2]["spec"]["template"]["spec"]["containers"][0]["env"].to_string();
    assert!(
        env.contains(r#"{"key":"token","name":"cifar10-token","optional":false}"#),
        "{env}"
    );
}

fn refusal(flags: &[(&'static str, &str)]) -> String {
    match project(flags).review(Renders::TrainingJob) {
        Ok(warnings) => panic!("accepted, with {warnings:#?}"),
        Err(e) => e.to_string(),
    }
}

fn warnings(flags: &[(&'static str, &str)]) -> Vec<String> {
    project(flags)
        .review(Renders::TrainingJob)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// A training pod larger than a node of the instance type it is pinned to can never be
/// scheduled: refused, with the node's figures and what fits. One larger than what a node is
/// expected to have left for pods (the default request) may fit: warned about. Pods not pinned
/// to the instance type are not measured against it.
#[test]
fn requests_larger_than_a_node_are_refused_with_the_figures() {
    let e = refusal(&[("job.cpu", "200")]);
    assert!(
        e.starts_with(r#"job.cpu = "200" (from flag --cpu): a c5.4xlarge node has 16 vCPUs"#)
            && e.contains("at most 13"),
        "{e}"
    );
    let e = refusal(&[("job.memory", "40Gi")]);
    assert!(
        e.starts_with(r#"job.memory = "40Gi" (from flag --memory): a c5.4xlarge node has 32 GiB"#)
            && e.contains("at most 25Gi"),
        "{e}"
    );
    let w = warnings(&[("job.cpu", "15"), ("image", "ecr/trainctl:1")]);
    assert_eq!(w.len(), 1, "{w:#?}");
    assert!(
        w[0].contains("job.cpu = 15") && w[0].contains("13 of its 16 vCPUs"),
        "{w:#?}"
    );
    let w = warnings(&[("job.memory", "30Gi"), ("image", "ecr/trainctl:1")]);
    assert!(w[0].contains("25Gi of its 32 GiB"), "{w:#?}");
    // The defaults fit; so does anything on nodes the pods are not pinned to.
    assert!(warnings(&[("image", "ecr/trainctl:1")]).is_empty());
    assert!(
        warnings(&[
            ("job.cpu", "200"),
            ("job.node_selector", "none"),
            ("image", "ecr/trainctl:1"),
        ])
        .is_empty()
    );
}

/// More pods than `cluster.nodes` nodes of the instance type hold are refused, elastic or not:
/// a Job ends only when every pod has, and those that do not fit would start only once the
/// others had finished. The refusal says how many fit and what to give instead.
#[test]
fn more_pods_than_the_node_group_holds_are_refused() {
    // An elastic Indexed Job ends whatever its size: it starts with what fits and grows.
    let w = warnings(&[("job.nnodes", "1:4"), ("image", "x/t:1")]);
    assert!(
        w.len() == 1
            && w[0].contains("hold 2 (1 a node)")
            && w[0].contains("the job starts with the pods that fit"),
        "{w:#?}"
    );
    // Unless its MIN cannot be placed.
    let e = refusal(&[("job.nnodes", "3:4")]);
    assert!(e.contains("hold 2 (1 a node)"), "{e}");
    // A PyTorchJob ends only when every worker has: a worker never placed would keep it.
    let e = refusal(&[("job.nnodes", "1:4"), ("job.launcher", "pytorchjob")]);
    assert!(
        e.starts_with(r#"job.nnodes = "1:4" (from flag --nnodes): 4 pods of 13 CPU and 25Gi memory, but 2 c5.4xlarge nodes"#)
            && e.contains("hold 2 (1 a node)")
            && e.contains("--nnodes 1:2")
            && e.contains("--nodes 4"),
        "{e}"
    );
    let e = refusal(&[("job.nnodes", "3")]);
    assert!(e.contains("--nnodes 2,") && e.contains("--nodes 3"), "{e}");
    // A larger node group, or smaller pods (three of 4 CPU and 8Gi a node), hold them.
    assert!(
        warnings(&[
            ("job.nnodes", "1:4"),
            ("cluster.nodes", "4"),
            ("image", "x/t:1")
        ])
        .is_empty()
    );
    let small = [("job.cpu", "4"), ("job.memory", "8Gi"), ("image", "x/t:1")];
    assert!(warnings(&[small.as_slice(), &[("job.nnodes", "6")]].concat()).is_empty());
    let e = refusal(&[small.as_slice(), &[("job.nnodes", "7")]].concat());
    assert!(e.contains("hold 6 (3 a node)"), "{e}");
    // A program's GPUs count too: two pods of 2 GPUs on a 4-GPU node.
    let e = refusal(&[
        ("cluster.instance_type", "g4dn.12xlarge"),
        ("job.command", "python train.py"),
        ("job.gpus_per_node", "2"),
        ("job.cpu", "8"),
        ("job.memory", "16Gi"),
        ("job.nnodes", "5"),
    ]);
    assert!(
        e.contains("and 2 GPUs") && e.contains("hold 4 (2 a node)"),
        "{e}"
    );
}

/// The default image (`trainctl:latest`, what `docker build -t trainctl .` tags) is in no
/// registry: every render or launch of pods that run it says so, with how to build and push
/// it and the setting that names it.
#[test]
fn the_default_image_is_said_to_be_in_no_registry() {
    let p = project(&[("storage.efs", "fs-1")]);
    for what in [Renders::TrainingJob, Renders::Doctor, Renders::HelperJob] {
        let w = p.review(what).unwrap();
        assert_eq!(w.len(), 1, "{w:#?}");
        assert!(
            w[0].starts_with("image trainctl:latest is the default, which no registry serves")
                && w[0].contains("docker build")
                && w[0].contains("--image (setting image, TRAINCTL_IMAGE)"),
            "{w:#?}"
        );
    }
    let p = project(&[("storage.efs", "fs-1"), ("image", "ecr/trainctl:0.1")]);
    for what in [Renders::TrainingJob, Renders::Doctor, Renders::HelperJob] {
        assert!(p.review(what).unwrap().is_empty());
    }
}
