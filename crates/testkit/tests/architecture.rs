//! ARCHITECTURE.md's dependency rules, checked against the workspace's manifests (`cargo
//! metadata`): each rule names a crate and what it must never reach, directly or through any
//! workspace crate it depends on. A new dependency that breaks one fails here, not in review.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

/// (crate, what it never depends on, why): ARCHITECTURE.md's "Invariants", first bullet.
const RULES: &[(&str, &[&str], &str)] = &[
    ("collective", &["burn"], "the collective knows no framework"),
    ("rendezvous", &["burn"], "the rendezvous knows no framework"),
    (
        "launcher",
        &["burn", "trainer"],
        "the launcher runs any program",
    ),
    ("kernels", &["burn"], "the kernels are plain f32 slices"),
    (
        "objects",
        &["burn", "trainer", "launcher"],
        "S3 is for the commands",
    ),
    (
        "telemetry",
        &["burn", "trainer"],
        "the records are read without a framework",
    ),
    (
        "report",
        &["burn", "trainer"],
        "reports are drawn without a framework",
    ),
    (
        "trainer",
        &["launcher", "objects", "deploy"],
        "the trainer reads and writes local files",
    ),
    (
        "deploy",
        &[
            "burn",
            "trainer",
            "launcher",
            "collective",
            "rendezvous",
            "kernels",
        ],
        "the Kubernetes side never links the framework or the runtime",
    ),
];

/// Every workspace crate's normal (not dev, not build) dependencies, by name, as its Cargo.toml
/// declares them (`cargo metadata --no-deps`: nothing is downloaded). Reaching burn through an
/// outside crate is not possible (only burn's own crates depend on burn), so the workspace's own
/// edges and its direct dependencies are the whole question.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| d["kind"].is_null())
                .map(|d| d["name"].as_str().unwrap().to_string())
                .collect();
            (p["name"].as_str().unwrap().to_string(), deps)
        })
        .collect()
}

/// Everything `from` reaches, and through which crate each was first reached.
fn reach(graph: &BTreeMap<String, BTreeSet<String>>, from: &str) -> BTreeMap<String, String> {
    let mut seen = BTreeMap::new();
    let mut todo = vec![from.to_string()];
    while let Some(at) = todo.pop() {
        for dep in graph.get(&at).into_iter().flatten() {
            if !seen.contains_key(dep) {
                seen.insert(dep.clone(), at.clone());
                todo.push(dep.clone());
            }
        }
    }
    seen
}

/// The contract is what every crate agrees on, so every crate may depend on it: it depends on
/// nothing at all.
#[test]
fn the_contract_depends_on_nothing() {
    let graph = graph();
    let deps = graph.get("contract").expect("a crate named contract");
    assert!(deps.is_empty(), "contract depends on {deps:?}");
    assert!(reach(&graph, "deploy").contains_key("contract"));
    assert!(reach(&graph, "collective").contains_key("contract"));
}

#[test]
fn no_crate_depends_on_what_architecture_md_forbids() {
    let graph = graph();
    let mut broken = Vec::new();
    for (krate, never, why) in RULES {
        assert!(
            graph.contains_key(*krate),
            "no crate {krate} in the workspace"
        );
        for (dep, via) in reach(&graph, krate) {
            // `burn` stands for the framework: burn itself and every burn-* crate.
            if never
                .iter()
                .any(|n| dep == *n || dep.starts_with(&format!("{n}-")))
            {
                broken.push(format!("{krate} reaches {dep} (through {via}): {why}"));
            }
        }
    }
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// The check itself would notice: the binary does reach burn (through trainer), and deploy
/// does reach objects, which it is allowed.
#[test]
fn the_graph_is_the_real_one() {
    let graph = graph();
    assert!(reach(&graph, "trainctl").contains_key("burn"));
    assert!(reach(&graph, "trainer").contains_key("kernels"));
    assert!(reach(&graph, "deploy").contains_key("objects"));
}
