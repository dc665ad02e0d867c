//! Tests of model files and checkpoints: round trips, damage detected, files from PyTorch
//! recognised, metadata checked.

use std::path::Path;

use safetensors::tensor::TensorView;

use super::tensors::encode;
use super::training::HEADER;
use super::*;
use crate::data::Normalisation;
use crate::model::{Architecture, SeedCnn, Snapshot, snapshot};

/// A mid-run position, for tests that need one.
pub(crate) fn progress() -> Progress {
    Progress {
        epoch: 3,
        position: 1280,
        global_step: 77,
        samples_seen: 9_000,
        epoch_digest: 0x0123_4567_89AB_CDEF,
        seed: 5,
        world_size: 2,
        dataset_len: 50_000,
        batch_size: 128,
        learning_rate: 1e-3,
        momentum: 0.9,
        weight_decay: 1e-4,
    }
}

fn model_state() -> (Snapshot, Vec<f32>) {
    let snap = snapshot(&SeedCnn::new(10, &crate::device::inference_device()));
    let momentum: Vec<f32> = (0..snap.params.len()).map(|i| i as f32 * 1e-3).collect();
    (snap, momentum)
}

/// A seed-CNN checkpoint written to `path` by [`save_checkpoint`]: its network and bytes.
fn saved_at(path: &Path) -> (Snapshot, Vec<u8>) {
    let (snap, momentum) = model_state();
    save_checkpoint(
        path,
        &snap,
        &momentum,
        &progress(),
        &ModelInfo::seed_cifar(),
    )
    .unwrap();
    let bytes = std::fs::read(path).unwrap();
    (snap, bytes)
}

/// A real checkpoint's payload (safetensors with progress, model metadata and momentum).
fn real_payload() -> &'static (Snapshot, Vec<u8>) {
    static PAYLOAD: std::sync::OnceLock<(Snapshot, Vec<u8>)> = std::sync::OnceLock::new();
    PAYLOAD.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let (snap, bytes) = saved_at(&dir.path().join("ckpt"));
        (snap, bytes[HEADER..].to_vec())
    })
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]

    /// A damaged payload behind a valid checksum (the fuzz target's ground, in CI): a byte
    /// of the safetensors header or metadata changed, or the payload cut short, is
    /// refused with a reason or read whole, never a panic, read as a checkpoint or as a
    /// model file.
    #[test]
    fn damaged_payloads_behind_a_valid_checksum_never_panic(
        at in 0usize..2048,
        byte in proptest::prelude::any::<u8>(),
        cut in proptest::prelude::prop_oneof![proptest::strategy::Just(0usize), 1usize..4096],
    ) {
        let (snap, payload) = real_payload();
        let mut damaged = payload.clone();
        let header = 8 + u64::from_le_bytes(payload[..8].try_into().unwrap()) as usize;
        damaged[at % header] = byte;
        damaged.truncate(damaged.len().saturating_sub(cut));
        let bytes = envelope(&damaged);
        if let Ok(c) = parse_checkpoint(&bytes, Some(snap)) {
            proptest::prop_assert_eq!(c.params.len(), snap.params.len());
        }
        let _ = parse_checkpoint(&bytes, None);
        let _ = describe_model(&damaged);
    }
}

#[test]
fn checkpoint_round_trips() {
    let (snap, momentum) = model_state();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt");
    save_checkpoint(
        &path,
        &snap,
        &momentum,
        &progress(),
        &ModelInfo::seed_cifar(),
    )
    .unwrap();
    let back = load_checkpoint(&path, Some(&snap)).unwrap().unwrap();
    assert_eq!(back.progress, progress());
    assert_eq!(back.info, ModelInfo::seed_cifar());
    let described = load_checkpoint(&path, None).unwrap().unwrap();
    assert_eq!(
        described.params, snap.params,
        "the network it names is rebuilt"
    );
    assert_eq!(back.params, snap.params);
    assert_eq!(back.buffers, snap.buffers);
    assert_eq!(back.momentum, momentum);
    assert!(
        load_checkpoint(&dir.path().join("none"), Some(&snap))
            .unwrap()
            .is_none()
    );
}

#[test]
fn corruption_and_truncation_are_detected() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt");
    let (snap, good) = saved_at(&path);

    let mut flipped = good.clone();
    let middle = flipped.len() / 2;
    flipped[middle] ^= 0x40;
    std::fs::write(&path, &flipped).unwrap();
    let err = load_checkpoint(&path, Some(&snap))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("checksum mismatch") && err.contains("not used"),
        "{err}"
    );

    std::fs::write(&path, &good[..good.len() - 100]).unwrap();
    let err = load_checkpoint(&path, Some(&snap))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("truncated"), "{err}");

    std::fs::write(&path, b"hello").unwrap();
    let err = load_checkpoint(&path, Some(&snap))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("not a trainctl checkpoint"), "{err}");
}

/// A file without trainctl's metadata (saved by PyTorch) is told by its keys.
#[test]
fn files_without_metadata_are_recognised_by_their_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let device = crate::device::inference_device();
    for (arch, classes) in [("resnet18", 7), ("resnet50", 3)] {
        let model = crate::model::Model::new(Architecture::parse(arch).unwrap(), classes, &device);
        let snap = snapshot(&model);
        let path = dir.path().join(arch);
        std::fs::write(&path, encode(&snap, None, 0, None).unwrap()).unwrap();
        let file = read_model(&path).unwrap();
        assert_eq!(file.info.architecture, arch);
        assert_eq!(file.info.classes.len(), classes);
        assert_eq!(file.info.normalisation, Normalisation::ImageNet);
        assert_eq!(file.tensors(&snap).unwrap().0, snap.params);
    }
    let (seed, _) = model_state();
    let path = dir.path().join("seed");
    std::fs::write(&path, encode(&seed, None, 0, None).unwrap()).unwrap();
    assert_eq!(read_model(&path).unwrap().info, ModelInfo::seed_cifar());
    std::fs::write(
        &path,
        safetensors::serialize(Vec::<(String, TensorView)>::new(), None).unwrap(),
    )
    .unwrap();
    let err = read_model(&path).err().unwrap().to_string();
    assert!(err.contains("neither the seed CNN's"), "{err}");
}

/// Sizes in a file's metadata are checked before anything is built from them: a seed CNN
/// file claiming a 1,000,000-pixel image (which once made `predict` take all the machine's
/// memory), a ResNet past the largest size, more classes than the classifier has, or none.
#[test]
fn metadata_sizes_are_checked_against_the_network_and_the_tensors() {
    let (snap, momentum) = model_state();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    let refused = |info: ModelInfo| {
        save_model(&path, &snap, 0, &info).unwrap();
        let model = read_model(&path).err().unwrap().to_string();
        let ckpt = dir.path().join("ckpt");
        save_checkpoint(&ckpt, &snap, &momentum, &progress(), &info).unwrap();
        let checkpoint = load_checkpoint(&ckpt, None).err().unwrap().to_string();
        (model, checkpoint)
    };
    let huge = ModelInfo {
        image_size: 1_000_000,
        ..ModelInfo::seed_cifar()
    };
    let (model, checkpoint) = refused(huge);
    for e in [&model, &checkpoint] {
        assert!(
            e.contains("trainctl.model says image_size 1000000: the seed CNN takes 32×32"),
            "{e}"
        );
    }
    let (model, _) = refused(ModelInfo {
        classes: (0..11).map(|i| i.to_string()).collect(),
        ..ModelInfo::seed_cifar()
    });
    assert!(
        model.contains("names 11 classes but its classifier (network.21.bias) has 10 outputs"),
        "{model}"
    );
    let (model, _) = refused(ModelInfo {
        classes: vec![],
        ..ModelInfo::seed_cifar()
    });
    assert!(
        model.contains("names 0 classes; a model has 1 to 100000"),
        "{model}"
    );
    // A ResNet file past the largest image size.
    let device = crate::device::inference_device();
    let resnet = snapshot(&crate::model::Model::new(
        Architecture::parse("resnet18").unwrap(),
        3,
        &device,
    ));
    let info = ModelInfo {
        architecture: "resnet18".into(),
        classes: vec!["a".into(), "b".into(), "c".into()],
        image_size: 4096,
        normalisation: Normalisation::ImageNet,
    };
    save_model(&path, &resnet, 0, &info).unwrap();
    let e = read_model(&path).err().unwrap().to_string();
    assert!(e.contains("at most 1024×1024 pixels"), "{e}");
    save_model(
        &path,
        &resnet,
        0,
        &ModelInfo {
            image_size: 64,
            ..info
        },
    )
    .unwrap();
    assert_eq!(read_model(&path).unwrap().info.image_size, 64);
}

#[test]
fn model_file_uses_pytorch_names_and_layout() {
    let (snap, _) = model_state();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    save_model(&path, &snap, 9, &ModelInfo::seed_cifar()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(|s| s.to_string()).collect();
    names.sort();
    for expected in [
        "network.0.weight",
        "network.0.bias",
        "network.5.weight",
        "network.5.bias",
        "network.5.running_mean",
        "network.5.running_var",
        "network.5.num_batches_tracked",
        "network.19.weight",
        "network.21.bias",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "{expected} missing from {names:?}"
        );
    }
    assert_eq!(names.len(), 6 * 2 + 3 * 5 + 2 * 2);
    assert_eq!(st.tensor("network.19.weight").unwrap().shape(), [512, 4096]);
    assert_eq!(
        st.tensor("network.0.weight").unwrap().shape(),
        [32, 3, 3, 3]
    );
    let file = read_model(&path).unwrap();
    assert_eq!(file.info, ModelInfo::seed_cifar());
    let (params, buffers) = file.tensors(&snap).unwrap();
    assert_eq!(
        (params, buffers),
        (snap.params.clone(), snap.buffers.clone())
    );
}
