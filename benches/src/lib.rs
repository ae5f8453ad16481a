//! Kiln's workloads and benchmarks (`kiln-bench`). Every workload prints its result beside a
//! reference measured in the same run (a plain syscall loop, a blocking thread pool, TCP on
//! loopback, GlusterFS where installed) and the ratio between them, because absolute times on
//! shared machines drift.
//!
//! Not a test suite: nothing here asserts timings. The wire codec's micro-benchmark lives in
//! `wire/benches/codec.rs`.
