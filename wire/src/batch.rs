//! BATCH: several fops of one caller in one request. The brick runs them one after another,
//! in the order given, each as if it had come alone, and answers each; a failed fop does not
//! stop the ones after it. A client holding a directory's write lease sends the changes it
//! made there this way, so the brick applies them in the order the application made them at
//! the cost of one round trip per batch.
//!
//! A batch carries only fops that name no fd and open nothing ([`FopRequest::batchable`]), at
//! most [`BATCH_FOPS_MAX`], and it must fit one frame.

use crate::codec::{Decode, DecodeError, Encode, Encoder, Reader};
use crate::errno::ErrorCode;
use crate::flags::Creds;
use crate::fop::{FopCode, FopReply, FopRequest};
use crate::limits::BATCH_FOPS_MAX;

/// The fops of one BATCH request, all run as `creds`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub creds: Creds,
    fops: Vec<FopRequest>,
}

/// Why a fop could not join a batch; the fop comes back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    #[error("{} names an fd or opens one: it cannot be batched", .0.code().name())]
    NotBatchable(Box<FopRequest>),
    #[error("a batch holds at most {BATCH_FOPS_MAX} fops")]
    Full(Box<FopRequest>),
}

impl Batch {
    pub fn new(creds: Creds) -> Batch {
        Batch {
            creds,
            fops: Vec::new(),
        }
    }

    /// Adds `fop` at the end.
    pub fn push(&mut self, fop: FopRequest) -> Result<(), BatchError> {
        if !fop.batchable() {
            return Err(BatchError::NotBatchable(Box::new(fop)));
        }
        if self.fops.len() == BATCH_FOPS_MAX {
            return Err(BatchError::Full(Box::new(fop)));
        }
        self.fops.push(fop);
        Ok(())
    }

    pub fn fops(&self) -> &[FopRequest] {
        &self.fops
    }

    pub fn into_fops(self) -> Vec<FopRequest> {
        self.fops
    }

    pub fn len(&self) -> usize {
        self.fops.len()
    }

    pub fn is_empty(&self) -> bool {
        self.fops.is_empty()
    }
}

/// Every fop is its code (`u16`) and its fields.
impl Encode for Batch {
    fn encode(&self, out: &mut Encoder) {
        self.creds.encode(out);
        put_count(out, self.fops.len());
        for fop in &self.fops {
            out.put_u16(fop.code() as u16);
            fop.encode_body(out);
        }
    }
}

impl Decode for Batch {
    fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
        let creds = Creds::decode(input)?;
        let count = take_count(input, "batch fops", 2)?;
        let mut batch = Batch::new(creds);
        for _ in 0..count {
            let fop = FopRequest::decode_body(fop_code(input)?, input)?;
            batch
                .push(fop)
                .map_err(|_| DecodeError::invalid("batch", "a fop that names or opens an fd"))?;
        }
        Ok(batch)
    }
}

/// The answer to each fop of a batch, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchReply {
    pub results: Vec<Result<FopReply, ErrorCode>>,
}

/// Every result is a status (`u16`: 0 or an error code); on success, the reply's code and
/// fields follow.
impl Encode for BatchReply {
    fn encode(&self, out: &mut Encoder) {
        put_count(out, self.results.len());
        for result in &self.results {
            match result {
                Ok(reply) => {
                    out.put_u16(0);
                    out.put_u16(reply.code() as u16);
                    reply.encode_body(out);
                }
                Err(error) => error.encode(out),
            }
        }
    }
}

impl Decode for BatchReply {
    fn decode(input: &mut Reader) -> Result<Self, DecodeError> {
        let count = take_count(input, "batch results", 2)?;
        let mut results = Vec::with_capacity(count);
        for _ in 0..count {
            results.push(match input.u16()? {
                0 => Ok(FopReply::decode_body(fop_code(input)?, input)?),
                status => {
                    Err(ErrorCode::from_wire(status)
                        .ok_or(DecodeError::UnknownErrorCode(status))?)
                }
            });
        }
        Ok(BatchReply { results })
    }
}

fn put_count(out: &mut Encoder, n: usize) {
    out.put_u32(u32::try_from(n).unwrap_or(u32::MAX));
}

/// A list's count, checked against [`BATCH_FOPS_MAX`] and the bytes left (each element takes
/// at least `element_len_min`).
fn take_count(
    input: &mut Reader,
    what: &'static str,
    element_len_min: usize,
) -> Result<usize, DecodeError> {
    let count = input.u32()? as usize;
    if count > BATCH_FOPS_MAX {
        return Err(DecodeError::TooLong {
            what,
            len: count,
            max: BATCH_FOPS_MAX,
        });
    }
    if count * element_len_min > input.remaining() {
        return Err(DecodeError::Truncated {
            needed: count * element_len_min,
            remaining: input.remaining(),
        });
    }
    Ok(count)
}

fn fop_code(input: &mut Reader) -> Result<FopCode, DecodeError> {
    let code = input.u16()?;
    FopCode::from_u16(code).ok_or(DecodeError::UnknownCode {
        kind: "batched fop",
        code,
    })
}

#[cfg(test)]
mod arbitrary {
    use proptest::prelude::*;

    use super::*;

    impl Arbitrary for Batch {
        type Parameters = ();
        type Strategy = BoxedStrategy<Self>;
        fn arbitrary_with((): ()) -> Self::Strategy {
            let fops = proptest::collection::vec(
                any::<FopRequest>().prop_filter("batchable", FopRequest::batchable),
                0..4,
            );
            (any::<Creds>(), fops)
                .prop_map(|(creds, fops)| Batch { creds, fops })
                .boxed()
        }
    }

    impl Arbitrary for BatchReply {
        type Parameters = ();
        type Strategy = BoxedStrategy<Self>;
        fn arbitrary_with((): ()) -> Self::Strategy {
            let result = prop_oneof![
                any::<FopReply>().prop_map(Ok),
                any::<ErrorCode>().prop_map(Err)
            ];
            proptest::collection::vec(result, 0..4)
                .prop_map(|results| BatchReply { results })
                .boxed()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fop::{Open, Stat};
    use crate::ids::Gfid;

    #[test]
    fn a_batch_refuses_fd_fops_and_opens_and_holds_at_most_its_limit() {
        let mut batch = Batch::new(Creds::root());
        let open = FopRequest::from(Open {
            gfid: Gfid::ROOT,
            access: crate::flags::AccessMode::ReadOnly,
            flags: crate::flags::OpenFlags::empty(),
        });
        assert!(matches!(batch.push(open), Err(BatchError::NotBatchable(_))));
        let stat = FopRequest::from(Stat { gfid: Gfid::ROOT });
        for _ in 0..BATCH_FOPS_MAX {
            batch.push(stat.clone()).expect("room");
        }
        assert!(matches!(batch.push(stat), Err(BatchError::Full(_))));
    }
}
