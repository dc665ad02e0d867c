//! trainctl on Kubernetes and EKS.
//!
//! - [`config`]: `trainctl.toml`, `TRAINCTL_*` and flags, layered and checked;
//! - [`catalog`]: EC2 instance types and the cluster presets;
//! - [`eksctl`]: eksctl's ClusterConfig and command lines;
//! - [`manifests`]: the Kubernetes objects (storage, data, training, test and doctor jobs);
//! - [`launchers`]: the kinds of training job (Indexed Job, PyTorchJob, TrainJob, MPIJob), one
//!   module each behind one trait, chosen from one table;
//! - [`status`]: a job's and its pods' state, read from the API's objects;
//! - [`kube_api`]: applying them and watching jobs through the Kubernetes API (kube-rs);
//! - [`doctor`]: the in-cluster checks of `trainctl doctor check`.
//!
//! Nothing here shells out to kubectl. eksctl is run (or its command printed) only by the CLI.

pub(crate) mod catalog;
pub mod config;
pub mod doctor;
pub mod eksctl;
pub mod kube_api;
pub mod launchers;
pub mod manifests;
pub mod status;
