//! `job top`: CPU and memory of the job's pods and their nodes, from the metrics API.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::ListParams;
use serde::Deserialize;

use super::error::{CLUSTER, api_error, is_not_found};
use super::{ApiError, Kube};
use crate::config::{bytes, millicores};
use crate::manifests;

impl Kube {
    /// CPU and memory of the job's pods and of the nodes they run on (the metrics API).
    pub async fn top(&self, name: &str) -> Result<Top, ApiError> {
        let pods = self.pods(name).await?;
        if pods.is_empty() {
            self.require_job(name).await?;
        }
        let selector = format!("{}={}", manifests::MANAGED_BY.0, manifests::MANAGED_BY.1);
        let url = format!(
            "/apis/metrics.k8s.io/v1beta1/namespaces/{}/pods?labelSelector={}",
            self.namespace,
            selector.replace('=', "%3D").replace(',', "%2C")
        );
        let pod_metrics: MetricsList<PodMetrics> = self.metrics(&url).await?;
        let node_metrics: MetricsList<NodeMetrics> =
            self.metrics("/apis/metrics.k8s.io/v1beta1/nodes").await?;
        let nodes: Api<Node> = Api::all(self.client.clone());
        let node_list = nodes
            .list(&ListParams::default())
            .await
            .map_err(|e| api_error("list nodes", CLUSTER, e))?;
        let allocatable: BTreeMap<String, (u64, u64)> = node_list
            .items
            .iter()
            .filter_map(|n| {
                let a = n.status.as_ref()?.allocatable.as_ref()?;
                Some((
                    n.metadata.name.clone()?,
                    (
                        a.get("cpu").and_then(|q| millicores(&q.0)).unwrap_or(0),
                        a.get("memory").and_then(|q| bytes(&q.0)).unwrap_or(0),
                    ),
                ))
            })
            .collect();
        let mut top = Top::default();
        for pod in &pods {
            let usage = pod_metrics
                .items
                .iter()
                .find(|m| m.metadata.name == pod.name)
                .map(|m| {
                    m.containers.iter().fold((0, 0), |(c, b), ct| {
                        (
                            c + millicores(&ct.usage.cpu).unwrap_or(0),
                            b + bytes(&ct.usage.memory).unwrap_or(0),
                        )
                    })
                });
            top.pods.push(Usage {
                name: pod.name.clone(),
                index: pod.index,
                node: pod.node.clone(),
                millicores: usage.map(|u| u.0),
                bytes: usage.map(|u| u.1),
                allocatable: None,
            });
        }
        let job_nodes: Vec<String> = pods.iter().filter_map(|p| p.node.clone()).collect();
        for m in &node_metrics.items {
            if !job_nodes.contains(&m.metadata.name) {
                continue;
            }
            top.nodes.push(Usage {
                name: m.metadata.name.clone(),
                index: None,
                node: None,
                millicores: millicores(&m.usage.cpu),
                bytes: bytes(&m.usage.memory),
                allocatable: allocatable.get(&m.metadata.name).copied(),
            });
        }
        Ok(top)
    }

    async fn metrics<T: serde::de::DeserializeOwned>(&self, url: &str) -> Result<T, ApiError> {
        let request = http::Request::get(url)
            .body(Vec::new())
            .map_err(|e| ApiError::Other {
                what: "metrics request".into(),
                message: e.to_string(),
            })?;
        match self.client.request::<T>(request).await {
            Ok(v) => Ok(v),
            Err(e) if is_not_found(&e) => Err(ApiError::MetricsMissing),
            // An unavailable aggregated API (metrics-server down) answers 503.
            Err(kube::Error::Api(s)) if s.code == 503 => Err(ApiError::MetricsMissing),
            Err(e) => Err(api_error("read the metrics API", &self.namespace, e)),
        }
    }
}

#[derive(Deserialize)]
struct MetricsList<T> {
    items: Vec<T>,
}

#[derive(Deserialize)]
struct MetricsMeta {
    name: String,
}

#[derive(Deserialize)]
struct ResourceUsage {
    cpu: String,
    memory: String,
}

#[derive(Deserialize)]
struct ContainerMetrics {
    usage: ResourceUsage,
}

#[derive(Deserialize)]
struct PodMetrics {
    metadata: MetricsMeta,
    containers: Vec<ContainerMetrics>,
}

#[derive(Deserialize)]
struct NodeMetrics {
    metadata: MetricsMeta,
    usage: ResourceUsage,
}

/// `job top`: usage per pod and per node.
#[derive(Debug, Default, Clone)]
pub struct Top {
    pub pods: Vec<Usage>,
    pub nodes: Vec<Usage>,
}

#[derive(Debug, Clone)]
pub struct Usage {
    pub name: String,
    pub index: Option<u32>,
    pub node: Option<String>,
    pub millicores: Option<u64>,
    pub bytes: Option<u64>,
    /// The node's allocatable (millicores, bytes).
    pub allocatable: Option<(u64, u64)>,
}

impl Top {
    pub fn render(&self) -> String {
        let mut s = String::new();
        let cpu = |m: Option<u64>| m.map_or("-".into(), |m| format!("{m}m"));
        let mem = |b: Option<u64>| b.map_or("-".into(), |b| format!("{}Mi", b / (1 << 20)));
        let _ = writeln!(
            s,
            "{:<32} {:>4} {:>10} {:>10}  ON",
            "POD", "NODE", "CPU", "MEMORY"
        );
        for p in &self.pods {
            let _ = writeln!(
                s,
                "{:<32} {:>4} {:>10} {:>10}  {}",
                p.name,
                p.index.map_or("-".into(), |i| i.to_string()),
                cpu(p.millicores),
                mem(p.bytes),
                p.node.as_deref().unwrap_or("(unscheduled)")
            );
        }
        if !self.nodes.is_empty() {
            s.push('\n');
            let _ = writeln!(
                s,
                "{:<32} {:>10} {:>5} {:>10} {:>5}",
                "NODE", "CPU", "CPU%", "MEMORY", "MEM%"
            );
            for n in &self.nodes {
                let pct = |used: Option<u64>, total: Option<u64>| match (used, total) {
                    (Some(u), Some(t)) if t > 0 => format!("{}%", u * 100 / t),
                    _ => "-".into(),
                };
                let _ = writeln!(
                    s,
                    "{:<32} {:>10} {:>5} {:>10} {:>5}",
                    n.name,
                    cpu(n.millicores),
                    pct(n.millicores, n.allocatable.map(|a| a.0)),
                    mem(n.bytes),
                    pct(n.bytes, n.allocatable.map(|a| a.1)),
                );
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_convert() {
        assert_eq!(millicores("2"), Some(2000));
        assert_eq!(millicores("250m"), Some(250));
        assert_eq!(millicores("123456789n"), Some(123));
        assert_eq!(millicores("x"), None);
        assert_eq!(bytes("512Ki"), Some(512 * 1024));
        assert_eq!(bytes("2Gi"), Some(2 << 30));
        assert_eq!(bytes("1G"), Some(1_000_000_000));
        assert_eq!(bytes("-1"), None);
    }
}
