//! `job logs`: every pod's lines merged in time order, or followed as they come, reattaching
//! when a pod's stream breaks.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::{AsyncBufReadExt, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::LogParams;
use tokio::sync::{mpsc, watch};

use super::error::{api_error, pod_logs_problem};
use super::{ApiError, Kube};
use crate::manifests;
use crate::status::{PodStatus, main_container};

/// How many polls `--follow` waits at most between two tries to reattach to a pod whose
/// stream broke: the waits double from one poll to this many (2 s to 16 s by default).
const REATTACH_MAX_POLLS: u32 = 8;

impl Kube {
    /// The logs of every pod of the job, each line prefixed with its pod and node index.
    ///
    /// Without `follow`, all lines so far, merged in time order (the API's timestamps). A pod
    /// whose logs cannot be read (its node's kubelet does not answer) is said so after the
    /// others' lines, and the call then returns [`ApiError::LogsMissing`] naming it.
    ///
    /// With `follow`, lines as they come, from pods as they start, until the job has finished
    /// and its streams have ended. A stream that breaks while its container runs (the kubelet
    /// restarted, or did not answer) is opened again, after a wait that doubles from one poll
    /// to [`REATTACH_MAX_POLLS`] polls, from the second of the last line shown; lines already
    /// shown are not shown again.
    pub async fn logs(
        &self,
        name: &str,
        follow: bool,
        out: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(), ApiError> {
        if follow {
            self.follow_logs(name, out).await
        } else {
            self.logs_so_far(name, out).await
        }
    }

    async fn logs_so_far(
        &self,
        name: &str,
        out: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(), ApiError> {
        let pods = self.pods(name).await?;
        if pods.is_empty() {
            self.require_job(name).await?;
        }
        if !pods.is_empty() && !pods.iter().any(PodStatus::has_started) {
            return Err(ApiError::NoLogsYet {
                name: name.into(),
                namespace: self.namespace.clone(),
                pods: pods
                    .iter()
                    .map(|p| match p.why.as_str() {
                        "" => format!("{} {}", p.name, p.phase.to_lowercase()),
                        why => format!("{} {}: {why}", p.name, p.phase.to_lowercase()),
                    })
                    .collect::<Vec<_>>()
                    .join("; "),
            });
        }
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let mut lines: Vec<(String, usize, String)> = Vec::new();
        // The pods whose logs could not be read (prefix, name), and why.
        let mut missing: Vec<(String, &str, String)> = Vec::new();
        for (order, pod) in pods.iter().enumerate() {
            if !pod.has_started() {
                continue;
            }
            if let Some(problem) = &pod.node_problem {
                // Its kubelet is not there to serve the logs: asking would only wait for the
                // API server's dial to time out.
                let why = format!("{problem}, so its kubelet cannot serve them");
                missing.push((pod.prefix(), &pod.name, why));
                continue;
            }
            let params = LogParams {
                container: Some(pod.container.clone()),
                timestamps: true,
                ..LogParams::default()
            };
            let text = match api.logs(&pod.name, &params).await {
                Ok(text) => text,
                Err(e) => match pod_logs_problem(pod.node.as_deref(), e) {
                    Ok(why) => {
                        missing.push((pod.prefix(), &pod.name, why));
                        continue;
                    }
                    Err(e) => {
                        let what = format!("logs of pod {}", pod.name);
                        return Err(api_error(&what, &self.namespace, e));
                    }
                },
            };
            for line in text.lines() {
                let (stamp, rest) = split_timestamp(line);
                lines.push((stamp.to_string(), order, pod.prefix() + rest));
            }
        }
        // Stable sort: lines of one pod keep their order when stamps tie.
        lines.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        for (_, _, line) in lines {
            out(&line);
        }
        for (prefix, _, why) in &missing {
            out(&format!("{prefix}(no logs: {why})"));
        }
        if missing.is_empty() {
            return Ok(());
        }
        let started = pods.iter().filter(|p| p.has_started()).count();
        Err(ApiError::LogsMissing {
            name: name.into(),
            namespace: self.namespace.clone(),
            missing: format!(
                "{} of the job's {started} pods: {}",
                missing.len(),
                missing
                    .iter()
                    .map(|(_, name, why)| format!("{name} ({why})"))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        })
    }

    async fn follow_logs(
        &self,
        name: &str,
        out: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(), ApiError> {
        let (tx, mut rx) = mpsc::channel::<String>(1024);
        let (job_done, done) = watch::channel(false);
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let mut streaming = Followers::default();
        let mut seen_job = false;
        let mut pending: BTreeMap<String, String> = BTreeMap::new();
        // Once the job is gone (deleted while followed): its pods' streams are read to their
        // end, up to this long (their grace period and a little), then that is said.
        let mut deleted: Option<tokio::time::Instant> = None;
        loop {
            let status = match (self.find_job(name).await?, deleted) {
                (Some(s), None) => Some(s),
                (None, None) if seen_job => {
                    job_done.send_replace(true);
                    let grace = manifests::TERMINATION_GRACE_SECONDS.unsigned_abs();
                    deleted = Some(tokio::time::Instant::now() + Duration::from_secs(grace + 15));
                    None
                }
                (None, None) => return Err(self.no_job(name)),
                (_, Some(_)) => None,
            };
            seen_job = true;
            let pods = if status.is_some() {
                self.pods(name).await?
            } else {
                Vec::new()
            };
            for pod in pods {
                if !pod.has_started() {
                    // Why it waits (unschedulable, pulling its image), once each time it changes.
                    if !pod.why.is_empty() && pending.get(&pod.uid) != Some(&pod.why) {
                        out(&format!(
                            "{}{} pending: {}",
                            pod.prefix(),
                            pod.name,
                            pod.why
                        ));
                        pending.insert(pod.uid.clone(), pod.why.clone());
                    }
                } else if !streaming.0.contains_key(&pod.uid) {
                    let follower = self.follower(&api, &pod, &tx, &done);
                    streaming
                        .0
                        .insert(pod.uid.clone(), tokio::spawn(follower.run()));
                }
            }
            let finished = status.as_ref().is_some_and(|s| s.phase.is_finished());
            if finished {
                // Followers waiting for a kubelet try once more, then stop.
                job_done.send_replace(true);
            }
            // Print what came in during a poll interval.
            let tick = tokio::time::sleep(self.poll);
            tokio::pin!(tick);
            loop {
                tokio::select! {
                    Some(line) = rx.recv() => out(&line),
                    () = &mut tick => break,
                }
            }
            let ended = streaming.0.values().all(|t| t.is_finished());
            if let Some(until) = deleted
                && (ended || tokio::time::Instant::now() >= until)
            {
                while let Ok(line) = rx.try_recv() {
                    out(&line);
                }
                out(&format!(
                    "(job {name} was deleted: its pods stopped{}; nothing more will come)",
                    if ended {
                        ", and their last lines are above"
                    } else {
                        ", some still stopping"
                    }
                ));
                return Ok(());
            }
            if finished && ended {
                while let Ok(line) = rx.try_recv() {
                    out(&line);
                }
                return Ok(());
            }
        }
    }

    /// The follower of `pod`'s logs, sending its lines on `lines` until `job_done`.
    fn follower(
        &self,
        api: &Api<Pod>,
        pod: &PodStatus,
        lines: &mpsc::Sender<String>,
        job_done: &watch::Receiver<bool>,
    ) -> Follower {
        Follower {
            api: api.clone(),
            pod: pod.name.clone(),
            container: pod.container.clone(),
            node: pod.node.clone(),
            prefix: pod.prefix(),
            namespace: self.namespace.clone(),
            lines: lines.clone(),
            job_done: job_done.clone(),
            first_wait: self.poll,
            max_wait: self.poll * REATTACH_MAX_POLLS,
        }
    }
}

/// The followers of a job's pods, by pod uid; those still running when `--follow` returns
/// (an error, or a caller that stopped waiting) are stopped with it.
#[derive(Default)]
struct Followers(BTreeMap<String, tokio::task::JoinHandle<()>>);

impl Drop for Followers {
    fn drop(&mut self) {
        for task in self.0.values() {
            task.abort();
        }
    }
}

/// Follows one pod's log stream until its container has ended, reattaching when the stream
/// breaks while it runs.
struct Follower {
    api: Api<Pod>,
    pod: String,
    container: String,
    node: Option<String>,
    prefix: String,
    namespace: String,
    lines: mpsc::Sender<String>,
    /// Becomes true when the job has finished: a follower waiting to reattach gives up.
    job_done: watch::Receiver<bool>,
    first_wait: Duration,
    max_wait: Duration,
}

/// Nobody reads a follower's lines any more: it stops.
struct Hangup;

impl Follower {
    async fn run(mut self) {
        let mut resume = Resume::default();
        let mut wait = self.first_wait;
        // Since when the stream has been broken, and the cause last said.
        let mut broken: Option<(tokio::time::Instant, String)> = None;
        // The container has ended: one last read, without following, for the lines a break
        // just before its end may have cut off.
        let mut last_read = false;
        loop {
            let params = LogParams {
                container: Some(self.container.clone()),
                follow: !last_read,
                timestamps: true,
                since_time: resume.since(),
                ..LogParams::default()
            };
            let cause = match self.api.log_stream(&self.pod, &params).await {
                Ok(stream) => {
                    if let Some((since, _)) = broken.take() {
                        let after = since.elapsed().as_secs();
                        self.say(&format!(
                            "(reattached after {after} s; what follows comes after the last line \
                             shown)"
                        ))
                        .await;
                    }
                    wait = self.first_wait;
                    resume.reopened();
                    match self.relay(stream, &mut resume).await {
                        Ok(cause) => cause,
                        Err(Hangup) => return,
                    }
                }
                Err(kube::Error::Api(s)) if s.code == 404 => return,
                Err(e) => Some(match pod_logs_problem(self.node.as_deref(), e) {
                    Ok(why) => why,
                    Err(e) => api_error(&format!("logs of pod {}", self.pod), &self.namespace, e)
                        .to_string(),
                }),
            };
            if last_read {
                if let Some(cause) = cause {
                    self.say(&format!("(its last lines could not be read: {cause})"))
                        .await;
                }
                return;
            }
            // The stream ended or did not open: go on only while the container runs.
            match self.ended(cause.is_none()).await {
                Ended::Gone => return,
                Ended::Yes => {
                    last_read = true;
                    continue;
                }
                Ended::No => {}
            }
            let cause = cause.unwrap_or_else(|| {
                "the log stream ended while the container still runs (its kubelet restarted, or \
                 the API server closed the stream)"
                    .into()
            });
            if *self.job_done.borrow() {
                self.say(&format!(
                    "(no more logs from this pod: the job has finished, and {cause})"
                ))
                .await;
                return;
            }
            if broken.as_ref().map(|(_, said)| said) != Some(&cause) {
                self.say(&format!(
                    "(logs interrupted: {cause}; waiting for the kubelet to answer again, trying \
                     every {} to {} s while the pod runs)",
                    self.first_wait.as_secs_f64(),
                    self.max_wait.as_secs_f64()
                ))
                .await;
            }
            let since = broken.map_or_else(tokio::time::Instant::now, |(since, _)| since);
            broken = Some((since, cause));
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                _ = self.job_done.changed() => {}
            }
            wait = (wait * 2).min(self.max_wait);
        }
    }

    /// Sends the stream's lines on, prefixed, repeats left out, until it ends: why it broke,
    /// if it did; [`Hangup`] when nobody reads the lines any more.
    async fn relay(
        &self,
        stream: impl futures::AsyncBufRead + Unpin,
        resume: &mut Resume,
    ) -> Result<Option<String>, Hangup> {
        let mut lines = stream.lines();
        while let Some(line) = lines.next().await {
            let line = match line {
                Ok(line) => line,
                Err(e) => return Ok(Some(format!("the log stream broke ({e})"))),
            };
            let said = match resume.admit(&line) {
                Admit::Line(text) => format!("{}{text}", self.prefix),
                // The kubelet's or API server's word in the stream (a log file already gone):
                // not the pod's output.
                Admit::Foreign(text) => format!("{}(not from the pod: {text})", self.prefix),
                Admit::Repeat => continue,
            };
            self.lines.send(said).await.map_err(|_| Hangup)?;
        }
        Ok(None)
    }

    /// Whether the container has ended, by its pod. After a stream that ended `clean` (no
    /// error), which most often means the container exited, a pod still said to run is asked
    /// once more after a poll interval: its status says the container ended a moment after
    /// it did. A pod being deleted whose stream ended cleanly has ended too.
    async fn ended(&self, clean: bool) -> Ended {
        let look = || async {
            match self.api.get_opt(&self.pod).await {
                Ok(None) => Ended::Gone,
                Ok(Some(pod)) if container_ended(&pod) => Ended::Yes,
                Ok(Some(pod)) if clean && pod.metadata.deletion_timestamp.is_some() => Ended::Yes,
                Ok(Some(_)) | Err(_) => Ended::No,
            }
        };
        match look().await {
            Ended::No if clean => {
                tokio::time::sleep(self.first_wait).await;
                look().await
            }
            seen => seen,
        }
    }

    async fn say(&self, what: &str) {
        let _ = self.lines.send(format!("{}{what}", self.prefix)).await;
    }
}

/// What a pod's state says of its container, once its stream ended.
enum Ended {
    /// The pod is gone: nothing more to read.
    Gone,
    /// The container has ended: one last read for its last lines.
    Yes,
    /// It still runs: the stream broke.
    No,
}

/// A line of a pod's log stream, as [`Resume::admit`] sorts it.
#[derive(Debug, PartialEq, Eq)]
enum Admit<'a> {
    /// The container's own line (its timestamp taken off).
    Line(&'a str),
    /// A line without the timestamp every line of the container carries: the kubelet's or
    /// the API server's word (`unable to retrieve container logs for ...`).
    Foreign(&'a str),
    /// Shown before (a reopened stream repeats its last second).
    Repeat,
}

/// Whether the pod's container (trainctl's) has ended (its pod finished): its log is complete.
fn container_ended(pod: &Pod) -> bool {
    let container = main_container(pod);
    let Some(status) = &pod.status else {
        return false;
    };
    if matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")) {
        return true;
    }
    status
        .container_statuses
        .iter()
        .flatten()
        .filter(|c| c.name == container)
        .any(|c| c.state.as_ref().is_some_and(|s| s.terminated.is_some()))
}

/// Where a pod's log stream stopped: the newest line's time, and how many lines shown carry
/// exactly that time. A stream opened again from that time's whole second (`sinceTime` has
/// whole seconds) repeats what was shown since then; those lines are skipped.
#[derive(Debug, Default)]
struct Resume {
    last: Option<Timestamp>,
    shown_at_last: usize,
    /// Lines at `last` seen in the current stream.
    seen_at_last: usize,
}

impl Resume {
    /// The `sinceTime` to reopen the stream from: the last line's second.
    fn since(&self) -> Option<Timestamp> {
        self.last
            .and_then(|t| Timestamp::from_second(t.as_second()).ok())
    }

    /// A new stream begins: it will repeat the lines at `last` from the first.
    fn reopened(&mut self) {
        self.seen_at_last = 0;
    }

    /// The text of `line` without its timestamp, unless it was shown before; a line without
    /// one is not the container's.
    fn admit<'a>(&mut self, line: &'a str) -> Admit<'a> {
        let (stamp, text) = split_timestamp(line);
        let Ok(at) = stamp.parse::<Timestamp>() else {
            return Admit::Foreign(text);
        };
        match self.last {
            Some(last) if at < last => Admit::Repeat,
            Some(last) if at == last => {
                self.seen_at_last += 1;
                if self.seen_at_last <= self.shown_at_last {
                    return Admit::Repeat;
                }
                self.shown_at_last += 1;
                Admit::Line(text)
            }
            _ => {
                self.last = Some(at);
                self.shown_at_last = 1;
                self.seen_at_last = 1;
                Admit::Line(text)
            }
        }
    }
}

fn split_timestamp(line: &str) -> (&str, &str) {
    match line.split_once(' ') {
        Some((stamp, rest)) if stamp.len() >= 20 && stamp.as_bytes()[4] == b'-' => (stamp, rest),
        _ => ("", line),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_split_off() {
        assert_eq!(
            split_timestamp("2026-11-21T10:00:00.123456789Z epoch 1"),
            ("2026-11-21T10:00:00.123456789Z", "epoch 1")
        );
        assert_eq!(split_timestamp("plain line"), ("", "plain line"));
    }

    /// A stream reopened from the last line's second repeats what was shown in that second
    /// (two lines there carry the same time): only the lines after it come through.
    #[test]
    fn a_reopened_stream_shows_only_new_lines() {
        let mut resume = Resume::default();
        let first = [
            "2026-11-21T10:00:00.900000000Z a",
            "2026-11-21T10:00:01.200000000Z b",
            "2026-11-21T10:00:01.500000000Z c",
            "2026-11-21T10:00:01.500000000Z d",
        ];
        let shown: Vec<_> = first
            .iter()
            .filter_map(|l| line_of(resume.admit(l)))
            .collect();
        assert_eq!(shown, ["a", "b", "c", "d"]);
        assert_eq!(
            resume.since().map(|t| t.to_string()).as_deref(),
            Some("2026-11-21T10:00:01Z"),
            "sinceTime is the last line's whole second, rounded down"
        );
        resume.reopened();
        let again = [
            "2026-11-21T10:00:01.200000000Z b",
            "2026-11-21T10:00:01.500000000Z c",
            "2026-11-21T10:00:01.500000000Z d",
            "2026-11-21T10:00:01.500000000Z e",
            "2026-11-21T10:00:02.000000000Z f",
        ];
        let shown: Vec<_> = again
            .iter()
            .filter_map(|l| line_of(resume.admit(l)))
            .collect();
        assert_eq!(shown, ["e", "f"]);
    }

    fn line_of(admit: Admit<'_>) -> Option<&str> {
        match admit {
            Admit::Line(text) => Some(text),
            Admit::Foreign(_) | Admit::Repeat => None,
        }
    }

    /// Issue 60, item 2: the kubelet's word in a pod's stream (its log file gone) has no
    /// timestamp, as every line of the container has: it is not shown as the pod's output.
    #[test]
    fn a_line_without_a_timestamp_is_the_kubelets_not_the_pods() {
        let mut resume = Resume::default();
        assert_eq!(
            resume.admit("unable to retrieve container logs for containerd://4f2a"),
            Admit::Foreign("unable to retrieve container logs for containerd://4f2a")
        );
        assert_eq!(
            resume.admit("2026-11-21T10:00:00.900000000Z a"),
            Admit::Line("a")
        );
    }
}
