//! The Hugging Face Trainer script (fixtures/hf_trainer.py through `trainctl.hf`) under three
//! agents, through a node lost and replaced and a node told to go: the survivors regroup in
//! place (never restarted, no checkpoint read), a joiner takes the model, optimizer, LR
//! scheduler and the trainer's step from a peer, every epoch trains each sample once, and every
//! rank ends with the same weights, step and learning rate. (Without faults, against the stock
//! Trainer: `pytorch::hugging_face`.)

use super::*;

/// Every rank's `HF rank R world W steps G lr L weights CRC` alike, at `world_size`.
pub(super) fn verify(outputs: &[String], world_size: usize) {
    let all = outputs.join("\n");
    let ends: Vec<String> = all
        .lines()
        .filter_map(|l| {
            let end = l.split("HF rank ").nth(1)?;
            // Past the rank: `world W steps G lr L weights CRC`.
            end.split_once(' ').map(|(_, rest)| rest.to_string())
        })
        .collect();
    assert_eq!(ends.len(), world_size, "an HF line per rank:\n{all}");
    assert!(
        ends.iter().all(|e| e == &ends[0] && e.starts_with(&format!("world {world_size} "))),
        "every rank ends with the same weights, step and learning rate: {ends:#?}\n{all}"
    );
    assert!(
        !all.contains("DivergedError") && !all.contains("UsageError"),
        "{all}"
    );
}

#[test]
fn c10d_hugging_face_node_lost_and_another_added_every_sample_once() {
    agent_lost_and_another_added(Cluster::hugging_face(Store::C10d, "c10d-hf-lost-added"));
}

#[test]
fn c10d_hugging_face_node_told_to_go_leaves_and_the_others_go_on() {
    agent_told_to_go(Cluster::hugging_face(Store::C10d, "c10d-hf-leave"), 3);
}
