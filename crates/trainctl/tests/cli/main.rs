//! End-to-end tests: the real `trainctl` binary, real worker processes, real TCP on 127.0.0.1,
//! small generated CIFAR-format data sets.

mod support;

mod data;
mod launch;
mod pytorch;
mod training;
