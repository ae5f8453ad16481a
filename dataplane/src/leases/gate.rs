//! The gate in front of every fop: disarmed while no lease and no revoked mark exist, so a
//! fop passes it unchecked, counted per epoch parity on its worker's own [`Slot`] until it
//! ends (as SRCU does), which lets the first grant wait for those fops to drain.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};

use super::lock;

/// Fops that passed the disarmed gate and are running, on one worker, by epoch parity. Its
/// own cache line, so workers never write each other's.
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct Slot {
    running: [AtomicUsize; 2],
}

/// A fop that passed the disarmed gate, counted until it ends.
#[derive(Debug)]
pub struct Unarmed<'a> {
    slot: &'a Slot,
    parity: usize,
}

impl Drop for Unarmed<'_> {
    fn drop(&mut self) {
        self.slot.running[self.parity].fetch_sub(1, SeqCst);
    }
}

/// Whether fops must be checked, and which ones passed unchecked (an SRCU-like epoch).
#[derive(Debug, Default)]
pub(super) struct Gate {
    armed: AtomicBool,
    epoch: AtomicUsize,
    pub(super) slots: Mutex<Vec<Arc<Slot>>>,
}

impl Gate {
    /// Passes a fop unchecked while disarmed, counting it in `slot` until the guard goes.
    ///
    /// Counted before `armed` is read, all sequentially consistent: either [`Gate::arm`]'s
    /// drain sees the count, or the fop sees the gate armed. The epoch read again catches an
    /// arming between the first read and the count (that count would be in the parity the
    /// next arming drains, not this one).
    pub(super) fn enter<'s>(&self, slot: &'s Slot) -> Option<Unarmed<'s>> {
        loop {
            let epoch = self.epoch.load(SeqCst);
            let parity = epoch & 1;
            slot.running[parity].fetch_add(1, SeqCst);
            if self.armed.load(SeqCst) {
                slot.running[parity].fetch_sub(1, SeqCst);
                return None;
            }
            if self.epoch.load(SeqCst) == epoch {
                return Some(Unarmed { slot, parity });
            }
            slot.running[parity].fetch_sub(1, SeqCst);
        }
    }

    /// Arms the gate: fops from now on are checked. Returns the parity of the fops that
    /// passed unchecked, to drain.
    pub(super) fn arm(&self) -> usize {
        self.armed.store(true, SeqCst);
        self.epoch.fetch_add(1, SeqCst) & 1
    }

    pub(super) fn disarm(&self) {
        self.armed.store(false, SeqCst);
    }

    pub(super) fn is_armed(&self) -> bool {
        self.armed.load(SeqCst)
    }

    /// Whether every fop counted in `parity` has ended.
    pub(super) fn drained(&self, parity: usize) -> bool {
        lock(&self.slots)
            .iter()
            .all(|s| s.running[parity].load(SeqCst) == 0)
    }
}
