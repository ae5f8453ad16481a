//! A client session's open files: a slab whose slots carry generation counters.
//!
//! Open, lookup and release are O(1) whatever the number of open files (GlusterFS's
//! `gf_fd_unused_get` scanned linearly). An [`FdId`] names a slot and the generation the slot had
//! when it was handed out; a released slot's generation moves on, so a stale or forged id gets
//! EBADF and never reaches a file opened later in the same slot, let alone another client's.

use kiln_wire::{FdId, Gfid};
use rustix::io::Errno;

use crate::op::{DirFd, FileRef};

/// Identifies one client session on a brick (one connection).
pub type SessionId = u64;

/// What a session holds open.
#[derive(Debug, Clone)]
pub enum OpenKind {
    File {
        file: FileRef,
        writable: bool,
    },
    /// An `O_RDONLY | O_DIRECTORY` fd for getdents; its read position belongs to READDIR.
    Dir {
        dir: DirFd,
        stream: std::sync::Arc<std::sync::Mutex<()>>,
    },
}

#[derive(Debug, Clone)]
pub struct OpenFile {
    pub gfid: Gfid,
    pub kind: OpenKind,
}

#[derive(Debug)]
struct Slot {
    generation: u32,
    entry: Option<OpenFile>,
}

/// One session's fd table, bounded by the per-client open-file limit.
#[derive(Debug)]
pub struct FdTable {
    slots: Vec<Slot>,
    free: Vec<u32>,
    open: usize,
    limit: usize,
    /// Open fds per file, so the last close of a file is known in O(1).
    per_file: std::collections::HashMap<Gfid, u32>,
}

impl FdTable {
    pub fn new(limit: usize) -> FdTable {
        FdTable {
            slots: Vec::new(),
            free: Vec::new(),
            open: 0,
            limit,
            per_file: std::collections::HashMap::new(),
        }
    }

    /// EMFILE when the table is at the per-client limit.
    pub fn check_room(&self) -> Result<(), Errno> {
        match self.open < self.limit {
            true => Ok(()),
            false => Err(Errno::MFILE),
        }
    }

    /// Stores `file` and returns its id; EMFILE at the per-client limit.
    pub fn insert(&mut self, file: OpenFile) -> Result<FdId, Errno> {
        self.check_room()?;
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                let slot = u32::try_from(self.slots.len()).map_err(|_| Errno::MFILE)?;
                self.slots.push(Slot {
                    generation: 0,
                    entry: None,
                });
                slot
            }
        };
        *self.per_file.entry(file.gfid).or_default() += 1;
        let s = &mut self.slots[slot as usize];
        s.entry = Some(file);
        self.open += 1;
        Ok(FdId {
            slot,
            generation: s.generation,
        })
    }

    /// The open file `id` names; EBADF for a released, stale or forged id.
    pub fn get(&self, id: FdId) -> Result<&OpenFile, Errno> {
        match self.slots.get(id.slot as usize) {
            Some(Slot {
                generation,
                entry: Some(file),
            }) if *generation == id.generation => Ok(file),
            _ => Err(Errno::BADF),
        }
    }

    /// Removes and returns the open file; its slot's next user gets a new generation.
    pub fn remove(&mut self, id: FdId) -> Result<OpenFile, Errno> {
        self.get(id)?;
        let s = &mut self.slots[id.slot as usize];
        let file = s.entry.take().ok_or(Errno::BADF)?;
        s.generation = s.generation.wrapping_add(1);
        self.free.push(id.slot);
        self.open -= 1;
        if let Some(n) = self.per_file.get_mut(&file.gfid) {
            *n -= 1;
            if *n == 0 {
                self.per_file.remove(&file.gfid);
            }
        }
        Ok(file)
    }

    /// Every open file, emptying the table (the session ended).
    pub fn drain(&mut self) -> Vec<OpenFile> {
        self.free.clear();
        self.open = 0;
        self.per_file.clear();
        self.slots.drain(..).filter_map(|s| s.entry).collect()
    }

    pub fn len(&self) -> usize {
        self.open
    }

    /// How many fds of this session are open on `gfid`.
    pub fn open_on(&self, gfid: &Gfid) -> u32 {
        self.per_file.get(gfid).copied().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.open == 0
    }
}

/// Bytes one open file costs in the table (the slot; the kernel's file is extra).
pub const FD_TABLE_ENTRY_BYTES: usize = size_of::<Slot>();

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> OpenFile {
        OpenFile {
            gfid: Gfid::ROOT,
            kind: OpenKind::File {
                file: FileRef::Fixed(0),
                writable: false,
            },
        }
    }

    #[test]
    fn stale_ids_get_ebadf() {
        let mut t = FdTable::new(10);
        let a = t.insert(file()).expect("room");
        t.remove(a).expect("open");
        let b = t.insert(file()).expect("room");
        assert_eq!(a.slot, b.slot, "slot reused");
        assert_ne!(a.generation, b.generation);
        assert_eq!(t.get(a).err(), Some(Errno::BADF));
        assert!(t.get(b).is_ok());
        assert_eq!(
            t.get(FdId {
                slot: 999,
                generation: 0
            })
            .err(),
            Some(Errno::BADF)
        );
        assert_eq!(t.remove(a).err(), Some(Errno::BADF));
    }

    #[test]
    fn limit_gives_emfile() {
        let mut t = FdTable::new(2);
        t.insert(file()).expect("room");
        t.insert(file()).expect("room");
        assert_eq!(t.insert(file()).err(), Some(Errno::MFILE));
        assert_eq!(t.drain().len(), 2);
        assert!(t.is_empty());
    }
}
