//! End-to-end tests: the real `trainctl` binary, real worker processes, real TCP on 127.0.0.1,
//! small generated CIFAR-format data sets; hosts as network namespaces and a real etcd server
//! for the elastic agent.

mod support;

mod cluster_e2e;
mod data;
mod elastic;
mod hints;
mod images;
mod kubernetes;
mod launch;
mod pods;
mod pytorch;
mod readme;
mod root_cause;
mod s3;
mod scale;
mod telemetry;
mod training;
