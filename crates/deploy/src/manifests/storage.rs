//! Shared storage: the StorageClass, PersistentVolume and ReadWriteMany claim of EFS, FSx or a
//! host path.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    CSIPersistentVolumeSource, HostPathVolumeSource, PersistentVolume, PersistentVolumeClaim,
    PersistentVolumeClaimSpec, PersistentVolumeSpec, VolumeResourceRequirements,
};
use k8s_openapi::api::storage::v1::StorageClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::config::{Project, StorageBackend};

use super::{Manifest, meta, quantity};

/// What `storage` renders: a StorageClass, a PersistentVolume and a ReadWriteMany claim.
#[derive(Debug, thiserror::Error)]
#[error(
    "no shared storage is configured; give --efs FS_ID, --fsx FS_ID,DNS,MOUNT or, on a one-node development cluster, --host-path DIR"
)]
pub struct NoStorage;

pub fn storage(project: &Project) -> Result<Vec<Manifest>, NoStorage> {
    let s = &project.storage;
    let backend = s.backend.as_ref().ok_or(NoStorage)?;
    let class = format!("{}-{}", s.claim, backend_name(backend));
    let (provisioner, source, mount_options, host_path) = match backend {
        StorageBackend::Efs { file_system_id } => (
            "efs.csi.aws.com",
            Some(CSIPersistentVolumeSource {
                driver: "efs.csi.aws.com".into(),
                volume_handle: file_system_id.clone(),
                ..CSIPersistentVolumeSource::default()
            }),
            None,
            None,
        ),
        StorageBackend::Fsx {
            file_system_id,
            dns_name,
            mount_name,
        } => (
            "fsx.csi.aws.com",
            Some(CSIPersistentVolumeSource {
                driver: "fsx.csi.aws.com".into(),
                volume_handle: file_system_id.clone(),
                volume_attributes: Some(BTreeMap::from([
                    ("dnsname".into(), dns_name.clone()),
                    ("mountname".into(), mount_name.clone()),
                ])),
                ..CSIPersistentVolumeSource::default()
            }),
            Some(vec!["flock".to_string()]),
            None,
        ),
        StorageBackend::HostPath { path } => (
            "kubernetes.io/no-provisioner",
            None,
            None,
            Some(HostPathVolumeSource {
                path: path.clone(),
                type_: Some("DirectoryOrCreate".into()),
            }),
        ),
    };
    let component = "storage";
    let class_object = StorageClass {
        metadata: ObjectMeta {
            namespace: None,
            ..meta(project, &class, component)
        },
        provisioner: provisioner.into(),
        reclaim_policy: Some("Retain".into()),
        volume_binding_mode: Some("Immediate".into()),
        mount_options: mount_options.clone(),
        ..StorageClass::default()
    };
    let volume = PersistentVolume {
        metadata: ObjectMeta {
            namespace: None,
            ..meta(project, &s.claim, component)
        },
        spec: Some(PersistentVolumeSpec {
            capacity: Some(BTreeMap::from([("storage".into(), quantity(&s.size))])),
            access_modes: Some(vec!["ReadWriteMany".into()]),
            volume_mode: Some("Filesystem".into()),
            persistent_volume_reclaim_policy: Some("Retain".into()),
            storage_class_name: Some(class.clone()),
            mount_options,
            csi: source,
            host_path,
            ..PersistentVolumeSpec::default()
        }),
        ..PersistentVolume::default()
    };
    let claim = PersistentVolumeClaim {
        metadata: meta(project, &s.claim, component),
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteMany".into()]),
            storage_class_name: Some(class),
            volume_name: Some(s.claim.clone()),
            resources: Some(VolumeResourceRequirements {
                requests: Some(BTreeMap::from([("storage".into(), quantity(&s.size))])),
                ..VolumeResourceRequirements::default()
            }),
            ..PersistentVolumeClaimSpec::default()
        }),
        ..PersistentVolumeClaim::default()
    };
    Ok(vec![
        Manifest::of(&class_object),
        Manifest::of(&volume),
        Manifest::of(&claim),
    ])
}

pub(super) fn backend_name(b: &StorageBackend) -> &'static str {
    match b {
        StorageBackend::Efs { .. } => "efs",
        StorageBackend::Fsx { .. } => "fsx",
        StorageBackend::HostPath { .. } => "hostpath",
    }
}
