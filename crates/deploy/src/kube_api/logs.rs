//! `job logs`: every pod's lines merged in time order, or followed as they come.

use std::collections::BTreeMap;

use futures::{AsyncBufReadExt, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::LogParams;

use super::error::api_error;
use super::status::PodStatus;
use super::{ApiError, Kube};
use crate::manifests::CONTAINER;

impl Kube {
    /// The logs of every pod of the job, each line prefixed with its pod and node index.
    /// Without `follow`, all lines so far, merged in time order (the API's timestamps). With
    /// `follow`, lines as they come, from pods as they start, until the job has finished and
    /// its streams have ended.
    pub async fn logs(
        &self,
        name: &str,
        follow: bool,
        out: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(), ApiError> {
        if !follow {
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
            for (order, pod) in pods.iter().enumerate() {
                if !pod.has_started() {
                    continue;
                }
                if pod.node_lost {
                    // The kubelet that serves its logs is gone: the API server would answer a
                    // bare 500 "connection refused".
                    lines.push((
                        String::new(),
                        order,
                        format!("{}(no logs: {})", pod.prefix(), pod.why),
                    ));
                    continue;
                }
                let params = LogParams {
                    container: Some(CONTAINER.into()),
                    timestamps: true,
                    ..LogParams::default()
                };
                let text = api.logs(&pod.name, &params).await.map_err(|e| {
                    api_error(&format!("logs of pod {}", pod.name), &self.namespace, e)
                })?;
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
            return Ok(());
        }
        self.follow_logs(name, out).await
    }

    async fn follow_logs(
        &self,
        name: &str,
        out: &mut (dyn FnMut(&str) + Send),
    ) -> Result<(), ApiError> {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<String>(1024);
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let mut streaming: BTreeMap<String, tokio::task::JoinHandle<()>> = BTreeMap::new();
        let mut seen_job = false;
        let mut pending: BTreeMap<String, String> = BTreeMap::new();
        loop {
            let status = match self.find_job(name).await? {
                Some(s) => s,
                None if seen_job => return Ok(()),
                None => return Err(self.no_job(name)),
            };
            seen_job = true;
            for pod in self.pods(name).await? {
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
                    continue;
                }
                if streaming.contains_key(&pod.uid) {
                    continue;
                }
                let api = api.clone();
                let tx = tx.clone();
                let prefix = pod.prefix();
                let pod_name = pod.name.clone();
                let task = tokio::spawn(async move {
                    let params = LogParams {
                        container: Some(CONTAINER.into()),
                        follow: true,
                        ..LogParams::default()
                    };
                    match api.log_stream(&pod_name, &params).await {
                        Ok(stream) => {
                            let mut lines = stream.lines();
                            while let Some(Ok(line)) = lines.next().await {
                                if tx.send(format!("{prefix}{line}")).await.is_err() {
                                    break;
                                }
                            }
                        }
                        Err(e) => {
                            let _ = tx.send(format!("{prefix}(no logs: {e})")).await;
                        }
                    }
                });
                streaming.insert(pod.uid.clone(), task);
            }
            let finished = status.phase.is_finished();
            // Print what came in during a poll interval.
            let tick = tokio::time::sleep(self.poll);
            tokio::pin!(tick);
            loop {
                tokio::select! {
                    Some(line) = rx.recv() => out(&line),
                    () = &mut tick => break,
                }
            }
            if finished && streaming.values().all(|t| t.is_finished()) {
                while let Ok(line) = rx.try_recv() {
                    out(&line);
                }
                return Ok(());
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
}
