//! eksctl's `ClusterConfig` (eksctl.io/v1alpha5) for a preset, and the eksctl command lines.
//!
//! The config has a system node group (CPU; kube-system, metrics-server, controllers) and a
//! worker node group (EFA where the instance has it, in the capacity reservation's zone and
//! subnet when there is one). OIDC is on, and the nodes may use EBS, EFS and FSx.

use serde_json::{Value, json};

use crate::config::{Cluster, Project, is_aws_id};

/// Why a cluster cannot be rendered as asked.
#[derive(Debug, thiserror::Error)]
#[error("{problem}; {hint}")]
pub struct ClusterConfigError {
    pub problem: String,
    pub hint: String,
}

fn refuse(problem: impl Into<String>, hint: impl Into<String>) -> ClusterConfigError {
    ClusterConfigError {
        problem: problem.into(),
        hint: hint.into(),
    }
}

pub(crate) const WORKER_GROUP: &str = "workers";
pub(crate) const SYSTEM_GROUP: &str = "system";
/// Label on every node, `system` or `worker`: the jobs' nodeSelector uses it.
pub(crate) const ROLE_LABEL: &str = "trainctl.dev/role";

/// The ClusterConfig document for `project`.
pub fn cluster_config(project: &Project) -> Result<Value, ClusterConfigError> {
    let c = &project.cluster;
    let worker = c.instance_type;
    let zones = &c.availability_zones;
    check_zones_and_reservation(c)?;
    let mut doc = base_document(c);

    // Where the worker group goes: one zone when EFA or a reservation pins it.
    let pinned_zone =
        (worker.supports_efa() || c.capacity_reservation_id.is_some()).then(|| zones[0].clone());
    let mut worker_subnet = None;
    // One zone given for a new VPC: the workers go there, whatever their type.
    let mut only_zone = None;
    match &c.existing_vpc {
        Some(vpc) => {
            doc["vpc"] = existing_vpc(c, vpc)?;
            if pinned_zone.is_some() {
                worker_subnet = Some(c.private_subnets[0].clone());
            }
        }
        None => {
            if !c.private_subnets.is_empty() {
                return Err(refuse(
                    "--private-subnets without --existing-vpc",
                    "give the VPC they belong to with --existing-vpc vpc-...",
                ));
            }
            if zones.len() == 1 {
                // EKS's control plane spans two zones: a new VPC gets a second one for it, and
                // the workers stay in the zone given (a reservation's, EFA's, or the user's).
                doc["availabilityZones"] = json!([zones[0].clone(), other_zone(&zones[0])]);
                if pinned_zone.is_none() {
                    only_zone = Some(zones[0].clone());
                }
            } else if !zones.is_empty() {
                doc["availabilityZones"] = json!(zones);
            }
        }
    }

    let workers = worker_group(
        c,
        worker_subnet,
        pinned_zone.as_ref().or(only_zone.as_ref()),
    );
    doc["managedNodeGroups"] = json!([system_group(c), workers]);
    if let Some(bucket) = &c.s3_bucket {
        doc["iam"]["serviceAccounts"] = json!([s3_service_account(project, bucket)]);
    }
    Ok(doc)
}

/// Refuses zones outside the region, a reservation preset without its reservation, a
/// reservation id that is not one or has no zone, and EFA workers without a zone.
fn check_zones_and_reservation(c: &Cluster) -> Result<(), ClusterConfigError> {
    let worker = c.instance_type;
    let zones = &c.availability_zones;
    for z in zones {
        if !z.starts_with(&c.region) {
            return Err(refuse(
                format!("availability zone {z} is not in region {}", c.region),
                format!("give zones of {} (e.g. {}a) with --az", c.region, c.region),
            ));
        }
    }
    if c.preset.needs_capacity_reservation() && c.capacity_reservation_id.is_none() {
        return Err(refuse(
            format!(
                "preset {} takes its {} nodes from an on-demand capacity reservation",
                c.preset.name(),
                worker.name
            ),
            "give its id with --capacity-reservation-id cr-... and its zone first in --az",
        ));
    }
    if let Some(id) = &c.capacity_reservation_id {
        if !is_aws_id(id, "cr-") {
            return Err(refuse(
                format!("capacity reservation id {id:?} is not an id"),
                "ids look like cr-0123456789abcdef0 (aws ec2 describe-capacity-reservations)",
            ));
        }
        if zones.is_empty() {
            return Err(refuse(
                "a capacity reservation lives in one availability zone",
                "give that zone first in --az",
            ));
        }
    }
    if worker.supports_efa() && zones.is_empty() {
        return Err(refuse(
            format!(
                "{} nodes use EFA, which needs one availability zone",
                worker.name
            ),
            format!(
                "give the workers' zone first in --az (e.g. --az {r}a,{r}b)",
                r = c.region
            ),
        ));
    }
    Ok(())
}

/// The document without its network and node groups: the cluster's name, region and version,
/// OIDC, and the add-ons.
fn base_document(c: &Cluster) -> Value {
    json!({
        "apiVersion": "eksctl.io/v1alpha5",
        "kind": "ClusterConfig",
        "metadata": {
            "name": c.name,
            "region": c.region,
            "version": c.version,
            "tags": { "app.kubernetes.io/managed-by": "trainctl" },
        },
        "iam": { "withOIDC": true },
        "addons": [
            { "name": "vpc-cni" },
            { "name": "coredns" },
            { "name": "kube-proxy" },
            { "name": "eks-pod-identity-agent" },
            { "name": "metrics-server" },
            { "name": "aws-efs-csi-driver", "useDefaultPodIdentityAssociations": true },
        ],
    })
}

/// The `vpc` section for the existing VPC `vpc`: its private subnets, keyed by their zones,
/// after checking the ids and that there is one zone (if any) per subnet.
fn existing_vpc(c: &Cluster, vpc: &str) -> Result<Value, ClusterConfigError> {
    let zones = &c.availability_zones;
    if !is_aws_id(vpc, "vpc-") {
        return Err(refuse(
            format!("--existing-vpc {vpc:?} is not a VPC id"),
            "ids look like vpc-0123456789abcdef0",
        ));
    }
    if c.private_subnets.is_empty() {
        return Err(refuse(
            "an existing VPC needs its private subnets",
            "give them with --private-subnets subnet-...,subnet-... (one per --az)",
        ));
    }
    if let Some(bad) = c.private_subnets.iter().find(|s| !is_aws_id(s, "subnet-")) {
        return Err(refuse(
            format!("{bad:?} is not a subnet id"),
            "ids look like subnet-0123456789abcdef0",
        ));
    }
    if !zones.is_empty() && zones.len() != c.private_subnets.len() {
        return Err(refuse(
            format!(
                "{} availability zones for {} private subnets",
                zones.len(),
                c.private_subnets.len()
            ),
            "give one zone per subnet, in the same order, with --az",
        ));
    }
    let mut private = serde_json::Map::new();
    for (i, subnet) in c.private_subnets.iter().enumerate() {
        let key = zones
            .get(i)
            .cloned()
            .unwrap_or_else(|| format!("private-{}", i + 1));
        private.insert(key, json!({ "id": subnet }));
    }
    Ok(json!({ "id": vpc, "subnets": { "private": private } }))
}

/// The system node group: one CPU node (two at most) for kube-system and the controllers.
fn system_group(c: &Cluster) -> Value {
    json!({
        "name": SYSTEM_GROUP,
        "instanceType": c.system_instance_type.name,
        "desiredCapacity": 1,
        "minSize": 1,
        "maxSize": 2,
        "privateNetworking": true,
        "labels": { ROLE_LABEL: "system" },
        "iam": { "withAddonPolicies": { "ebs": true, "efs": true, "cloudWatch": true } },
    })
}

/// The worker node group: EFA where the instance has it, in `subnet` or else in `zone` when
/// one is given, from the capacity reservation if any, GPU nodes tainted.
fn worker_group(c: &Cluster, subnet: Option<String>, zone: Option<&String>) -> Value {
    let worker = c.instance_type;
    let mut workers = json!({
        "name": WORKER_GROUP,
        "instanceType": worker.name,
        "desiredCapacity": c.nodes,
        "minSize": 0,
        "maxSize": c.nodes,
        "privateNetworking": true,
        "volumeSize": if worker.gpus > 0 { 500 } else { 100 },
        "labels": { ROLE_LABEL: "worker" },
        "iam": { "withAddonPolicies": { "ebs": true, "efs": true, "fsx": true, "cloudWatch": true } },
    });
    if worker.supports_efa() {
        workers["efaEnabled"] = json!(true);
    }
    if let Some(subnet) = subnet {
        workers["subnets"] = json!([subnet]);
    } else if let Some(zone) = zone {
        workers["availabilityZones"] = json!([zone]);
    }
    if let Some(id) = &c.capacity_reservation_id {
        workers["capacityReservation"] =
            json!({ "capacityReservationTarget": { "capacityReservationID": id } });
    }
    if worker.gpus > 0 {
        // Only GPU pods land on GPU nodes; the device plugin tolerates this taint.
        workers["taints"] =
            json!([{ "key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule" }]);
    }
    workers
}

/// IRSA for the pods: a service account whose IAM role may list `bucket` and read, write and
/// delete its objects (multipart uploads included), and nothing else.
fn s3_service_account(project: &Project, bucket: &str) -> Value {
    let name = project
        .service_account
        .as_deref()
        .unwrap_or(crate::config::S3_SERVICE_ACCOUNT);
    json!({
        "metadata": {
            "name": name,
            "namespace": project.namespace,
            "labels": { "app.kubernetes.io/managed-by": "trainctl" },
        },
        "attachPolicy": {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Action": ["s3:ListBucket", "s3:GetBucketLocation"],
                    "Resource": format!("arn:aws:s3:::{bucket}"),
                },
                {
                    "Effect": "Allow",
                    "Action": [
                        "s3:GetObject",
                        "s3:PutObject",
                        "s3:DeleteObject",
                        "s3:AbortMultipartUpload",
                        "s3:ListMultipartUploadParts",
                    ],
                    "Resource": format!("arn:aws:s3:::{bucket}/*"),
                },
            ],
        },
    })
}

fn other_zone(zone: &str) -> String {
    let (base, last) = zone.split_at(zone.len().saturating_sub(1));
    let next = if last == "a" { "b" } else { "a" };
    format!("{base}{next}")
}

/// The eksctl command lines for `cluster create|delete`, with the config written to `file`.
pub fn create_command(file: &str) -> Vec<String> {
    ["eksctl", "create", "cluster", "-f", file]
        .map(String::from)
        .to_vec()
}

pub fn delete_command(project: &Project) -> Vec<String> {
    vec![
        "eksctl".into(),
        "delete".into(),
        "cluster".into(),
        "--name".into(),
        project.cluster.name.clone(),
        "--region".into(),
        project.cluster.region.clone(),
        "--wait".into(),
    ]
}

/// `cluster addons`: creates the config's EKS add-ons (metrics-server, the EFS CSI driver...)
/// that the cluster does not have yet.
pub fn addons_command(file: &str) -> Vec<String> {
    ["eksctl", "create", "addon", "-f", file]
        .map(String::from)
        .to_vec()
}
