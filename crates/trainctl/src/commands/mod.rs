//! One file per subcommand: parse, call the library, report.

pub mod bench;
pub mod checkpoint;
pub mod data;
pub mod eval;
pub mod install;
pub mod kube;
pub mod predict;
pub mod project;
pub mod report;
pub mod run;
pub mod s3;
pub mod train;
