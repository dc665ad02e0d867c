//! Why this node's workers regroup, kept until they say they did.

/// Why this node's workers were handed each round they have not yet said they train in, by
/// the count of assignments that handed it. Rounds can follow each other faster than the
/// workers regroup (a node joins, then another leaves): each report of a regroup carries its
/// own assignment count and takes the causes up to it, so a regroup that took two rounds at
/// once says both, and none says another's.
#[derive(Default)]
pub(super) struct Causes(Vec<(u64, String)>);

impl Causes {
    pub(super) fn handed(&mut self, assignments: u64, cause: String) {
        self.0.push((assignments, cause));
    }

    pub(super) fn pending(&self) -> bool {
        !self.0.is_empty()
    }

    /// The causes of the rounds up to the workers' `assignments`, no longer pending.
    pub(super) fn reported(&mut self, assignments: u64) -> String {
        let (done, later): (Vec<_>, Vec<_>) =
            self.0.drain(..).partition(|(n, _)| *n <= assignments);
        self.0 = later;
        let mut causes: Vec<String> = done.into_iter().map(|(_, c)| c).collect();
        causes.dedup();
        causes.join("; then ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_report_says_its_own_rounds_cause() {
        let mut causes = Causes::default();
        causes.handed(1, "node c joins".into());
        // The next round comes before the workers report the first.
        causes.handed(2, "node b leaves (SIGTERM)".into());
        assert!(causes.pending());
        assert_eq!(causes.reported(1), "node c joins");
        assert!(causes.pending());
        assert_eq!(causes.reported(2), "node b leaves (SIGTERM)");
        assert!(!causes.pending());
        // Workers that took two rounds at once say both.
        causes.handed(3, "node d is gone".into());
        causes.handed(4, "node e joins".into());
        assert_eq!(causes.reported(4), "node d is gone; then node e joins");
        assert!(!causes.pending());
    }
}
