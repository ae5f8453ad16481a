//! Kiln's workloads and benchmarks (`kiln-bench`). Every workload prints its result beside a
//! reference measured in the same run (a plain syscall loop, a blocking thread pool, TCP on
//! loopback, a passthrough FUSE mount, GlusterFS where installed) and the ratio between them,
//! because absolute times on shared machines drift. Output is a table for people or, with
//! `--json`, JSON Lines with the fields of `docs/benchmarks.md`.
//!
//! Not a test suite: nothing here asserts timings. The wire codec's micro-benchmark lives in
//! `wire/benches/codec.rs`.

pub mod bricks;
pub mod engine;
pub mod handoff;
pub mod lookup_scale;
pub mod mgmt;
pub mod mount;
pub mod net;
pub mod openfds;
pub mod plot;
pub mod process;
pub mod progress;
pub mod rebalance;
pub mod report;
pub mod rng;
pub mod scratch;
pub mod smallfile;
pub mod std_loop;
