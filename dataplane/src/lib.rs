//! The Kiln brick: serves fops on one brick directory.
//!
//! It owns the GlusterFS-compatible on-disk layout (`trusted.gfid` xattrs, `.glusterfs/XX/YY`
//! handles), the io_uring engine and the blocking engine that share one fop contract, the
//! per-client fd tables and the GFID cache. It is the only crate with `unsafe` code, fenced in
//! the ring and buffer modules.
//!
//! It is not the protocol (that is `kiln-wire`), not configuration storage (that is
//! `kiln-mgmt`), and not a client.
