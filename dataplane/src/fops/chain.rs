//! A chain under construction, and its results, addressed by typed handles instead of
//! indexes: `let pre = chain.push::<Stat>(step)` … `results.take(pre)?` gives the `Stat` that
//! step returned, or the errno it failed with.

use std::marker::PhantomData;

use bytes::Bytes;
use rustix::io::Errno;

use crate::op::{Done, FileRef, Stat, Step, StepResult, invariant};

/// A step's result as a fop wants it.
pub(crate) trait FromDone: Sized {
    fn from_done(done: Done) -> Option<Self>;
}

impl FromDone for Stat {
    fn from_done(done: Done) -> Option<Stat> {
        match done {
            Done::Stat(stat) => Some(stat),
            _ => None,
        }
    }
}

impl FromDone for FileRef {
    fn from_done(done: Done) -> Option<FileRef> {
        match done {
            Done::Opened(file) => Some(file),
            _ => None,
        }
    }
}

impl FromDone for Bytes {
    fn from_done(done: Done) -> Option<Bytes> {
        match done {
            Done::Data(data) => Some(data),
            _ => None,
        }
    }
}

/// Any successful result, its value unused.
impl FromDone for () {
    fn from_done(_: Done) -> Option<()> {
        Some(())
    }
}

/// Where one step's result will be, and of what type.
#[derive(Debug)]
pub(crate) struct At<T> {
    index: usize,
    _result: PhantomData<fn() -> T>,
}

impl<T> Clone for At<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for At<T> {}

impl<T> At<T> {
    /// This step's position in its chain: steps pushed before it come first.
    pub(crate) fn index(self) -> usize {
        self.index
    }

    /// The same step, for asking only whether it succeeded.
    pub(crate) fn erased(self) -> At<()> {
        At {
            index: self.index,
            _result: PhantomData,
        }
    }
}

/// Steps in the order they will run.
#[derive(Debug, Default)]
pub(crate) struct Chain {
    steps: Vec<Step>,
}

impl Chain {
    pub(crate) fn new() -> Chain {
        Chain::default()
    }

    /// Appends `step`; its result is read back as a `T`.
    pub(crate) fn push<T: FromDone>(&mut self, step: Step) -> At<T> {
        self.steps.push(step);
        At {
            index: self.steps.len() - 1,
            _result: PhantomData,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.steps.len()
    }

    /// Keeps only the first `n` steps (the crash-injection hook).
    pub(crate) fn truncate(&mut self, n: usize) {
        self.steps.truncate(n);
    }

    pub(crate) fn into_steps(self) -> Vec<Step> {
        self.steps
    }
}

/// The results of a chain that ran, one per step.
#[derive(Debug)]
pub(crate) struct Results {
    results: Vec<Option<StepResult>>,
}

impl Results {
    pub(crate) fn new(results: Vec<StepResult>, steps: usize) -> Results {
        debug_assert_eq!(results.len(), steps, "an executor lost results");
        Results {
            results: results.into_iter().map(Some).collect(),
        }
    }

    /// The step's value, or the errno it failed with.
    pub(crate) fn take<T: FromDone>(&mut self, at: At<T>) -> Result<T, Errno> {
        let Some(result) = self.results.get_mut(at.index).and_then(Option::take) else {
            return Err(invariant("a step's result was taken twice or never made"));
        };
        T::from_done(result?).ok_or_else(|| invariant("a step returned the wrong kind of value"))
    }

    /// Whether the step succeeded (its value stays for [`Results::take`]).
    pub(crate) fn ok<T>(&self, at: At<T>) -> bool {
        matches!(self.results.get(at.index), Some(Some(Ok(_))))
    }

    /// The step's `statx`, when it succeeded (it stays for [`Results::take`]).
    pub(crate) fn stat(&self, at: At<Stat>) -> Option<&Stat> {
        match self.results.get(at.index) {
            Some(Some(Ok(Done::Stat(stat)))) => Some(stat),
            _ => None,
        }
    }

    /// Counts a failed step as done: what it was to make, another fop made meanwhile.
    pub(crate) fn excuse(&mut self, at: At<()>) {
        debug_assert!(self.error(at).is_some(), "only a failed step is excused");
        self.results[at.index] = Some(Ok(Done::Value(0)));
    }

    /// The step's errno, if it failed.
    pub(crate) fn error<T>(&self, at: At<T>) -> Option<Errno> {
        match self.results.get(at.index) {
            Some(Some(Err(e))) => Some(*e),
            _ => None,
        }
    }

    /// The first error among steps `from..to` (by position), if any.
    pub(crate) fn first_error_between(&self, from: usize, to: usize) -> Option<Errno> {
        self.results
            .get(from..to.min(self.results.len()))?
            .iter()
            .find_map(|r| match r {
                Some(Err(e)) => Some(*e),
                _ => None,
            })
    }

    /// The first error of any step.
    pub(crate) fn first_error(&self) -> Option<Errno> {
        self.first_error_between(0, self.results.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::{Close, FileRef};

    fn close() -> Step {
        Step::brick(Close {
            file: FileRef::Fixed(0),
        })
    }

    #[test]
    fn results_come_back_by_handle_and_type() {
        let mut chain = Chain::new();
        let a = chain.push::<()>(close());
        let b = chain.push::<Stat>(close());
        assert_eq!((a.index(), b.index(), chain.len()), (0, 1, 2));
        let mut results = Results::new(
            vec![Ok(Done::Value(0)), Err(Errno::NOENT)],
            chain.into_steps().len(),
        );
        assert!(results.ok(a));
        assert_eq!(results.error(b), Some(Errno::NOENT));
        assert_eq!(results.first_error(), Some(Errno::NOENT));
        assert_eq!(results.first_error_between(0, 1), None);
        assert_eq!(results.take(a), Ok(()));
        assert_eq!(results.take(b), Err(Errno::NOENT));
    }

    #[test]
    #[should_panic(expected = "broken invariant")]
    fn a_result_taken_twice_is_a_bug() {
        let mut chain = Chain::new();
        let a = chain.push::<()>(close());
        let mut results = Results::new(vec![Ok(Done::Value(0))], chain.len());
        let _ = results.take(a);
        let _ = results.take(a);
    }
}
