use proptest::prelude::*;

use super::*;

fn step(n: u64) -> Record {
    Record::Step(Step {
        time: 1_700_000_000.5 + n as f64,
        rank: 1,
        world_size: 2,
        restart: 0,
        epoch: 1,
        step: n,
        iter: n as usize,
        steps_in_epoch: 196,
        loss: 2.25,
        accuracy: 0.125,
        lr: 1e-3,
        images: 256,
        images_per_sec: 118.5,
        step_s: 2.16,
        data_s: 0.01,
        compute_s: 2.0,
        allreduce_s: 0.15,
        slowdown: Some(1.0),
    })
}

fn start() -> Record {
    Record::Start(Start {
        v: SCHEMA_VERSION,
        time: 1_700_000_000.0,
        rank: 1,
        world_size: 2,
        restart: 0,
        step: 0,
        resumed: false,
        from_peer: false,
        health: None,
        config: RunConfig {
            run_id: "cifar10".into(),
            epochs: 10,
            batch_size: 128,
            learning_rate: 1e-3,
            momentum: 0.9,
            weight_decay: 1e-4,
            seed: 0,
            threads: 1,
            checkpoint_every: None,
            data: "./data".into(),
            backend: "flex".into(),
            version: "0.1.0".into(),
            model: "seed-cnn".into(),
            image_size: 32,
            precision: "fp32".into(),
        },
    })
}

/// The documented field names (docs/METRICS.md) are what is written: a renamed field breaks
/// every reader and dashboard, so it must break this test first.
#[test]
fn step_records_have_the_documented_fields() {
    let line = step(7).to_line();
    assert_eq!(line.last(), Some(&b'\n'));
    assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1);
    let v: serde_json::Value = serde_json::from_slice(&line).unwrap();
    let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(|k| k.as_str()).collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "accuracy",
            "allreduce_s",
            "compute_s",
            "data_s",
            "epoch",
            "images",
            "images_per_sec",
            "iter",
            "kind",
            "loss",
            "lr",
            "rank",
            "restart",
            "slowdown",
            "step",
            "step_s",
            "steps_in_epoch",
            "time",
            "world_size"
        ]
    );
    assert_eq!(v["kind"], "step");
    let v: serde_json::Value = serde_json::from_slice(&start().to_line()).unwrap();
    assert_eq!(v["kind"], "start");
    assert_eq!(v["v"], SCHEMA_VERSION);
    assert_eq!(v["config"]["batch_size"], 128);
}

#[test]
fn writer_appends_whole_lines_and_ends_a_partial_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = rank_file(dir.path(), 1);
    let mut w = MetricsWriter::open(&path).unwrap();
    w.write(&start()).unwrap();
    w.write(&step(1)).unwrap();
    drop(w);
    // A crash in the middle of a write: half of a record, no newline.
    let half = step(2).to_line();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes.extend_from_slice(&half[..half.len() / 2]);
    std::fs::write(&path, &bytes).unwrap();

    let read = read_metrics(&path).unwrap();
    assert_eq!(read.records, vec![start(), step(1)]);
    assert_eq!(read.skipped, 1);

    // The restarted worker appends after the fragment, not onto it.
    let mut w = MetricsWriter::open(&path).unwrap();
    w.write(&step(3)).unwrap();
    let read = read_metrics(&path).unwrap();
    assert_eq!(read.records, vec![start(), step(1), step(3)]);
    assert_eq!(read.skipped, 1);
}

#[test]
fn unknown_kinds_and_garbage_are_skipped() {
    let mut bytes = step(1).to_line();
    bytes.extend_from_slice(b"{\"kind\":\"from_the_future\",\"time\":1}\n\xff\xfe\n\n");
    bytes.extend_from_slice(&step(2).to_line());
    let read = parse_metrics(&bytes);
    assert_eq!(read.records, vec![step(1), step(2)]);
    assert_eq!(read.skipped, 2);
}

#[test]
fn a_run_directory_is_read_by_rank() {
    let dir = tempfile::tempdir().unwrap();
    for rank in [1, 0] {
        MetricsWriter::open(&rank_file(dir.path(), rank))
            .unwrap()
            .write(&step(rank as u64))
            .unwrap();
    }
    std::fs::write(dir.path().join("metrics").join("notes.txt"), "x").unwrap();
    let run = read_run(dir.path()).unwrap();
    assert_eq!(
        run.iter()
            .map(|(r, m)| (*r, m.records.len()))
            .collect::<Vec<_>>(),
        [(0, 1), (1, 1)]
    );
}

proptest! {
    /// A file cut at any byte (a crash at any moment) reads back as the records written
    /// before the cut, losing at most the one being written.
    #[test]
    fn any_cut_loses_at_most_the_last_record(n in 1u64..6, cut_frac in 0.0f64..=1.0) {
        let lines: Vec<Vec<u8>> = (0..n).map(|i| step(i).to_line()).collect();
        let all: Vec<u8> = lines.concat();
        let cut = (all.len() as f64 * cut_frac) as usize;
        let read = parse_metrics(&all[..cut]);
        let whole = lines.iter().scan(0, |end, l| { *end += l.len(); Some(*end) })
            .take_while(|&end| end <= cut).count();
        prop_assert!(read.records.len() == whole || read.records.len() == whole + 1);
        for (i, r) in read.records.iter().enumerate() {
            prop_assert_eq!(r, &step(i as u64));
        }
        prop_assert!(read.skipped <= 1);
    }

    #[test]
    fn reading_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = parse_metrics(&bytes);
    }
}
