//! The xattrs and attributes a move sets on one brick's copy of a file, as root.

use super::*;

impl<L: Layer> Distribute<L> {
    /// Copies the xattrs of file `gfid` from brick `from` to `to`, but DHT's and the GFID.
    pub(super) async fn copy_xattrs(
        &self,
        from: usize,
        to: usize,
        gfid: Gfid,
    ) -> Result<(), Error> {
        let root = Creds::root();
        let names = match self
            .bricks
            .get(from)?
            .call(&root, kiln_wire::Listxattr { gfid }.into())
            .await?
        {
            FopReply::Listxattr(r) => r.entries,
            other => return Err(unexpected(&other)),
        };
        for name in names {
            let bytes = name.as_bytes();
            if bytes == b"trusted.gfid" || bytes.starts_with(b"trusted.glusterfs.") {
                continue;
            }
            let get = kiln_wire::Getxattr {
                gfid,
                name: name.clone(),
            };
            let value = match self.bricks.get(from)?.call(&root, get.into()).await {
                Ok(FopReply::Getxattr(r)) => r.value,
                Ok(other) => return Err(unexpected(&other)),
                Err(Error::Fop(ErrorCode::NoData)) => continue,
                Err(e) => return Err(e),
            };
            let set = kiln_wire::Setxattr {
                gfid,
                name,
                value,
                mode: XattrSetMode::Upsert,
            };
            self.bricks.get(to)?.call(&root, set.into()).await?;
        }
        Ok(())
    }

    pub(super) async fn set_xattr(
        &self,
        brick: usize,
        gfid: Gfid,
        name: &'static str,
        value: XattrValue,
    ) -> Result<(), Error> {
        let set = kiln_wire::Setxattr {
            gfid,
            name: xattr_name(name),
            value,
            mode: XattrSetMode::Upsert,
        };
        self.bricks
            .get(brick)?
            .call(&Creds::root(), set.into())
            .await
            .map(drop)
    }

    pub(super) async fn remove_xattr(
        &self,
        brick: usize,
        gfid: Gfid,
        name: &'static str,
    ) -> Result<(), Error> {
        let remove = kiln_wire::Removexattr {
            gfid,
            name: xattr_name(name),
        };
        self.bricks
            .get(brick)?
            .call(&Creds::root(), remove.into())
            .await
            .map(drop)
    }

    pub(in crate::distribute::layer) async fn set_mode(
        &self,
        brick: usize,
        gfid: Gfid,
        mode: u32,
    ) -> Result<(), Error> {
        let attr = kiln_wire::SetAttr {
            mode: Some(Mode::new(mode).ok_or(Error::Fop(ErrorCode::Inval))?),
            ..kiln_wire::SetAttr::default()
        };
        self.set_attr(brick, gfid, attr).await
    }

    pub(super) async fn set_attr(
        &self,
        brick: usize,
        gfid: Gfid,
        attr: kiln_wire::SetAttr,
    ) -> Result<(), Error> {
        self.change_attr(brick, gfid, attr).await.map(drop)
    }

    /// [`Distribute::set_attr`]; the attributes the object had when the brick changed them.
    pub(super) async fn change_attr(
        &self,
        brick: usize,
        gfid: Gfid,
        attr: kiln_wire::SetAttr,
    ) -> Result<Iatt, Error> {
        let setattr = kiln_wire::Setattr { gfid, attr };
        match self
            .bricks
            .get(brick)?
            .call(&Creds::root(), setattr.into())
            .await?
        {
            FopReply::Setattr(change) => Ok(change.pre),
            other => Err(unexpected(&other)),
        }
    }
}

pub(in crate::distribute::layer) fn size_attr(size: u64) -> kiln_wire::SetAttr {
    kiln_wire::SetAttr {
        size: Some(size),
        ..kiln_wire::SetAttr::default()
    }
}
