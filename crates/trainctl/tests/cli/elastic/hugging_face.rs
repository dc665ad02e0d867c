//! The Hugging Face Trainer script (fixtures/hf_trainer.py through `trainctl.hf`) under three
//! agents, through a node lost and replaced and a node told to go: the survivors regroup in
//! place (never restarted, no checkpoint read), a joiner takes the model, optimizer, LR
//! scheduler and the trainer's step from a peer, every epoch trains each sample once, and every
//! rank ends with the same weights, step and learning rate. (Without faults, against the stock
//! Trainer: `pytorch::hugging_face`.)

use super::*;

/// Every rank's `HF rank R world W steps G lr L weights CRC` alike, at `world_size`.
pub(super) fn verify(outputs: &[String], world_size: usize) {
    verify_rank_ends(outputs, world_size, "HF rank ", None);
}

#[test]
fn c10d_hugging_face_node_lost_and_another_added_every_sample_once() {
    agent_lost_and_another_added(Cluster::hugging_face(Store::C10d, "c10d-hf-lost-added"));
}

#[test]
fn c10d_hugging_face_node_told_to_go_leaves_and_the_others_go_on() {
    agent_told_to_go(Cluster::hugging_face(Store::C10d, "c10d-hf-leave"), 3);
}

/// The whole job stopped (SIGTERM to every agent, as a deleted job): every rank stops at one
/// step boundary and exits 143, rank 0's checkpoint holds the last step trained, and the same
/// command resumes there, at the exact sample: every epoch trains each sample once, no step
/// twice, and every rank ends with the same weights.
#[test]
fn c10d_hugging_face_job_stopped_checkpoints_and_resumes_at_the_exact_sample() {
    let Some(mut c) = Cluster::hugging_face(Store::C10d, "c10d-hf-stop") else {
        return;
    };
    let agents: Vec<usize> = (1..=3).map(|h| c.start(h, 1)).collect();
    c.wait_for_progress(3);
    for &a in &agents {
        sigterm(&c.agents[a]);
    }
    for &a in &agents {
        let status = c.agents[a].wait(JOB_TIMEOUT);
        assert_eq!(
            status.code(),
            Some(143),
            "agent {a} exits 143:\n{}",
            c.agents[a].output()
        );
    }
    assert_eq!(
        c.torch_checkpoint_step(),
        Some(c.last_recorded_step()),
        "the checkpoint holds the last step trained"
    );
    c.nnodes = "3:3";
    let outputs = c.run_again_from_the_checkpoint();
    c.verify_end(&outputs, 3);
    c.verify_exactly_once();
}
