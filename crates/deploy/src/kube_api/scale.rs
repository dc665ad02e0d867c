//! `job scale`: a running job's number of nodes changed in place, within its `--nnodes`
//! bounds, by the patch its launcher names ([`crate::launchers::Kind::size_patch`]).

use kube::api::{Patch, PatchParams};

use super::error::api_error;
use super::{ApiError, Kube};
use crate::manifests::{NNODES_ANNOTATION, QUEUE_LABEL, SPARES_ANNOTATION, TRAINER_ANNOTATION};

/// What `job scale` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scaled {
    pub name: String,
    /// The launcher's name (`indexed`, `pytorchjob`).
    pub launcher: &'static str,
    pub from: u32,
    pub to: u32,
    /// The job runs the user's program (which regroups in place only with `trainctl.torch`).
    pub program: bool,
    /// The Kueue queue the job was admitted through, if any.
    pub queue: Option<String>,
    /// Pods it keeps beyond `--nnodes` MAX as spares (`job launch --spares`).
    pub spares: u32,
    /// Its `--nnodes` MAX.
    pub max: u32,
}

impl Scaled {
    /// What `job scale` says it did and what the job does now, one line per fact.
    pub fn describe(&self) -> Vec<String> {
        let Scaled { name, from, to, .. } = self;
        if from == to {
            return vec![format!(
                "job {name} asks for {to} nodes already; nothing to change"
            )];
        }
        let mut lines = Vec::new();
        let pods = pods_between(*from.min(to), *from.max(to));
        let one = from.abs_diff(*to) == 1;
        if to < from {
            let (leave, agents) = if one {
                ("leaves", "its agent leaves")
            } else {
                ("leave", "their agents leave")
            };
            lines.push(format!(
                "job {name}: {from} → {to} nodes: {pods} {leave} ({agents} at the next step; the \
                 others regroup in place); the job trains on at {to} nodes"
            ));
        } else {
            let (start, joins) = if one {
                ("starts", "it joins")
            } else {
                ("start", "each joins")
            };
            lines.push(format!(
                "job {name}: {from} → {to} nodes: {pods} {start}; {joins} at the next step once \
                 scheduled and takes the state from a peer; `trainctl job status --name {name}` \
                 shows a pod still Pending and why"
            ));
        }
        if self.program {
            lines.push(
                "your program regroups in place only if it uses trainctl.torch; otherwise every \
                 node's workers restart at the new size (torchrun's behaviour), from your \
                 checkpoint"
                    .into(),
            );
        } else {
            lines.push(
                "no worker restarts: the built-in trainer regroups in place (workers still \
                 starting, right after a launch, start again at the new size)"
                    .into(),
            );
        }
        if self.spares > 0 {
            let pods = to + self.spares;
            lines.push(if pods > self.max {
                format!(
                    "its {} spare(s) stay: {pods} pods, of which {} train and {} wait warm to \
                     take a node's place",
                    self.spares,
                    self.max.min(pods),
                    pods - self.max.min(pods)
                )
            } else {
                format!(
                    "its {} spare(s) stay, so it has {pods} pods, and all of them train: a spare \
                     waits only while the job is at its maximum of {} nodes",
                    self.spares, self.max
                )
            });
        }
        if let Some(queue) = &self.queue
            && to > from
        {
            lines.push(format!(
                "queue {queue}: Kueue admits the larger size as a new workload slice (Kueue 0.13 \
                 or later with its ElasticJobsViaWorkloadSlices feature gate); a Kueue without \
                 it suspends and requeues the job instead, which restarts every pod"
            ));
        }
        lines
    }
}

/// `pod 3`, `pods 2 and 3`, `pods 2, 3 and 4`: the node indexes from `low` up to `high`.
fn pods_between(low: u32, high: u32) -> String {
    let ids: Vec<String> = (low..high).map(|i| i.to_string()).collect();
    match ids.as_slice() {
        [one] => format!("pod {one}"),
        [rest @ .., last] => format!("pods {} and {last}", rest.join(", ")),
        [] => "no pods".into(),
    }
}

/// Why a job was not scaled.
#[derive(Debug, thiserror::Error)]
pub enum ScaleError {
    /// The size asked for is outside the job's bounds: a bad command line.
    #[error(
        "job {name} runs with --nnodes {min}:{max}, so it can be scaled to {min}..={max} nodes, \
         not {asked}; give a size in that range (the bounds are fixed at launch: relaunch with \
         another --nnodes to change them)"
    )]
    OutOfBounds {
        name: String,
        asked: u32,
        min: u32,
        max: u32,
    },
    /// The job cannot change size in place, said with why and what to do.
    #[error("job {name} cannot be scaled: {why}")]
    Cannot { name: String, why: String },
    #[error(transparent)]
    Api(#[from] ApiError),
}

impl ScaleError {
    /// A size the job's bounds refuse: the command line was wrong (exit 2).
    pub fn is_usage(&self) -> bool {
        matches!(self, ScaleError::OutOfBounds { .. })
    }
}

/// `MIN:MAX` as the job's annotation holds it.
fn bounds(text: &str) -> Option<(u32, u32)> {
    let (min, max) = text.split_once(':')?;
    let (min, max) = (min.trim().parse().ok()?, max.trim().parse().ok()?);
    (0 < min && min <= max).then_some((min, max))
}

impl Kube {
    /// Asks job `name` for `nodes` nodes: refused outside its `--nnodes` bounds, for a
    /// launcher that cannot scale in place, and for a job that has finished.
    pub async fn scale(&self, name: &str, nodes: u32) -> Result<Scaled, ScaleError> {
        let (kind, object) = self
            .find_object(name)
            .await?
            .ok_or_else(|| self.no_job(name))?;
        let cannot = |why: String| ScaleError::Cannot {
            name: name.to_string(),
            why,
        };
        kind.scales().map_err(|why| cannot(why.to_string()))?;
        let status = kind.status(&object);
        if status.phase.is_finished() {
            return Err(cannot(format!(
                "it has {} already; `trainctl job status --name {name}` shows how it ended",
                status.phase
            )));
        }
        let annotations = object.metadata.annotations.clone().unwrap_or_default();
        let labels = object.metadata.labels.clone().unwrap_or_default();
        let Some((min, max)) = annotations.get(NNODES_ANNOTATION).and_then(|b| bounds(b)) else {
            return Err(cannot(format!(
                "it has no {NNODES_ANNOTATION} annotation (launched by a trainctl before `job \
                 scale`, or not by trainctl), so its bounds are unknown; relaunch it with \
                 `trainctl job launch --nnodes MIN:MAX`"
            )));
        };
        if !(min..=max).contains(&nodes) {
            return Err(ScaleError::OutOfBounds {
                name: name.to_string(),
                asked: nodes,
                min,
                max,
            });
        }
        // Its size counts the spares' pods; what `job scale` asks for does not.
        let spares: u32 = annotations
            .get(SPARES_ANNOTATION)
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        let from = kind
            .size(&object)
            .map_or(max, |pods| pods.saturating_sub(spares));
        let scaled = Scaled {
            name: name.to_string(),
            launcher: kind.name(),
            from,
            to: nodes,
            program: annotations.get(TRAINER_ANNOTATION).map(String::as_str) == Some("program"),
            queue: labels.get(QUEUE_LABEL).cloned(),
            spares,
            max,
        };
        if from == nodes {
            return Ok(scaled);
        }
        let patch = kind
            .size_patch(nodes + spares)
            .ok_or_else(|| cannot("its launcher names no patch for its size".into()))?;
        let resource = &kind.resources()[0];
        self.api(resource, true)
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|e| {
                api_error(
                    &format!("scale {} {name}", resource.kind),
                    &self.namespace,
                    e,
                )
            })?;
        Ok(scaled)
    }
}

#[cfg(test)]
mod tests {
    use super::{Scaled, bounds, pods_between};

    #[test]
    fn scaling_says_which_pods_go_or_come_and_what_restarts() {
        assert_eq!(pods_between(3, 4), "pod 3");
        assert_eq!(pods_between(2, 4), "pods 2 and 3");
        assert_eq!(pods_between(1, 4), "pods 1, 2 and 3");
        let down = Scaled {
            name: "j".into(),
            launcher: "indexed",
            from: 4,
            to: 2,
            program: false,
            queue: Some("q".into()),
            spares: 0,
            max: 4,
        };
        let said = down.describe().join("\n");
        assert!(said.contains("4 → 2 nodes: pods 2 and 3 leave"), "{said}");
        assert!(said.contains("trains on at 2 nodes"), "{said}");
        assert!(said.contains("no worker restarts"), "{said}");
        assert!(
            !said.contains("Kueue"),
            "a smaller size needs no admission: {said}"
        );
        let up = Scaled {
            from: 2,
            to: 4,
            program: true,
            ..down
        };
        let said = up.describe().join("\n");
        assert!(said.contains("2 → 4 nodes: pods 2 and 3 start"), "{said}");
        assert!(said.contains("only if it uses trainctl.torch"), "{said}");
        assert!(said.contains("ElasticJobsViaWorkloadSlices"), "{said}");
        let with_a_spare = Scaled {
            from: 4,
            to: 2,
            spares: 1,
            ..up
        };
        let said = with_a_spare.describe().join("\n");
        assert!(
            said.contains("its 1 spare(s) stay, so it has 3 pods, and all of them train"),
            "{said}"
        );
        let at_max = Scaled {
            from: 2,
            to: 4,
            ..with_a_spare
        };
        let said = at_max.describe().join("\n");
        assert!(
            said.contains("5 pods, of which 4 train and 1 wait warm"),
            "{said}"
        );
    }

    #[test]
    fn bounds_read_min_colon_max_and_refuse_anything_else() {
        assert_eq!(bounds("2:4"), Some((2, 4)));
        assert_eq!(bounds(" 1 : 1 "), Some((1, 1)));
        for bad in ["4", "4:2", "0:2", "a:b", "", "2:"] {
            assert_eq!(bounds(bad), None, "{bad}");
        }
    }
}
