//! The blocking executor: each step is one ordinary system call on the calling thread. It is
//! the reference the io_uring engine is measured against, and the fallback where io_uring is
//! unavailable.

use rustix::io::Errno;

use super::Exec;
use crate::creds::ActAs;
use crate::op::{Done, FileRef, Step, StepResult, Who};

/// Runs every step inline.
#[derive(Debug, Default, Clone, Copy)]
pub struct BlockingExec;

impl Exec for BlockingExec {
    async fn run(&self, steps: Vec<Step>) -> Vec<StepResult> {
        run_chain(steps)
    }

    async fn blocking<T: Send + 'static>(&self, work: impl FnOnce() -> T + Send + 'static) -> T {
        crate::profile::charge(|c| c.pool_jobs += 1);
        work()
    }
}

/// Runs a chain: every step in order, except that a failed barrier cancels the rest.
pub fn run_chain(steps: Vec<Step>) -> Vec<StepResult> {
    let mut failed = false;
    let mut opened: Option<FileRef> = None;
    steps
        .into_iter()
        .map(|mut step| {
            if failed {
                return Err(Errno::CANCELED);
            }
            if let Some(file) = &opened {
                step.op.resolve_chain_file(file);
            }
            let barrier = step.barrier;
            let result = run_step(step);
            if let Ok(Done::Opened(file)) = &result {
                opened = Some(file.clone());
            }
            failed = barrier && result.is_err();
            result
        })
        .collect()
}

/// Runs one step with its credentials.
pub fn run_step(step: Step) -> StepResult {
    let _as = match &step.who {
        Who::Brick => None,
        Who::Caller(creds) => Some(ActAs::new(creds)?),
    };
    step.op.blocking()
}
