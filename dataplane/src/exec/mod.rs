//! Executors: how a chain of [`Step`]s reaches the kernel. The fop logic (`crate::fops`) is
//! written once against [`Exec`]; [`blocking::BlockingExec`] makes one syscall per step on the
//! calling thread, [`uring::UringExec`] turns a chain into linked SQEs submitted with the other
//! fops of the same loop turn and sends what blocks to a [`pool::BlockingPool`] (the blocking
//! executor already runs on one).

pub mod blocking;
pub mod pool;
pub mod uring;

use std::future::Future;

use crate::op::{Step, StepResult};

/// Runs chains of steps and blocking work.
pub trait Exec {
    /// Runs `steps` in order as one chain. A failed step cancels the ones after it, which
    /// report `ECANCELED`; the result has one entry per step.
    fn run(&self, steps: Vec<Step>) -> impl Future<Output = Vec<StepResult>>;

    /// Runs `work` where blocking is allowed: calls that have no io_uring opcode (getdents,
    /// chmod/chown/utimes, listxattr, …).
    fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> impl Future<Output = T>;
}
