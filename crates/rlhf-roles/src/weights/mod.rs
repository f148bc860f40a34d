//! Weight lists for sync and checksums: every parameter of a model as host f32, in the
//! model's parameter order, on both sides of a sync. When every rank of a sync computes on a
//! GPU of one node the weights go through the trainer's GPU memory instead ([`ipc`]); the
//! ranks agree on that at the start of every sync.

pub mod ipc;

use std::time::Instant;

use candle_core::{DType, Tensor};
use rlhf_collective::{checksum, BucketedSync, Communicator, Param, ParamMut, SyncStats};
use rlhf_model::Model;

use crate::error::{Ctx, Result};

/// One parameter on the host.
pub struct HostParam {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// The model's parameters as host f32, in parameter order.
pub fn host_params(model: &Model) -> Result<Vec<HostParam>> {
    to_host(&model.named_tensors())
}

fn to_host(tensors: &[(String, Tensor)]) -> Result<Vec<HostParam>> {
    tensors
        .iter()
        .map(|(name, t)| {
            let name = name.clone();
            let shape = t.dims().to_vec();
            let data = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            Ok(HostParam { name, shape, data })
        })
        .collect()
}

fn views(params: &[HostParam]) -> Result<Vec<Param<'_>>> {
    params
        .iter()
        .map(|p| Ok(Param::f32(p.name.clone(), &p.shape, &p.data)?))
        .collect()
}

/// `rlhf_collective::checksum` over the model's parameters.
///
/// A ZeRO-3 model's is of this rank's pieces (no collective); its whole weights' checksum is
/// that of `Zero3::gather_all`.
pub fn weights_checksum(model: &Model) -> Result<u64> {
    tensors_checksum(&model.named_tensors())
}

/// The same checksum over named tensors in parameter order (a checkpoint's copy).
pub fn tensors_checksum(tensors: &[(String, Tensor)]) -> Result<u64> {
    let params = to_host(tensors)?;
    Ok(checksum(&views(&params)?))
}

fn bucketed(bucket_bytes: usize) -> Result<BucketedSync> {
    if bucket_bytes == 0 {
        Ok(BucketedSync::default())
    } else {
        Ok(BucketedSync::new(bucket_bytes)?)
    }
}

/// Root side of a sync: sends every parameter; returns the stats and the checksum (of the
/// bytes sent: [`checksum`] on the host path, [`rlhf_model::ipc::hash`] over CUDA IPC).
pub fn send_weights(
    model: &Model,
    comm: &mut dyn Communicator,
    bucket_bytes: usize,
    st: &mut ipc::IpcState,
) -> Result<(SyncStats, u64)> {
    send_weights_from(model, None, comm, bucket_bytes, st)
}

/// [`send_weights`] of `gathered`, a ZeRO-3 model's whole weights gathered from its group
/// (`Zero3::gather_all_host`, the model's parameter order), when given: they go by the host path
/// (a sharded model offers no CUDA IPC, so the ranks agree on that).
pub fn send_weights_from(
    model: &Model,
    gathered: Option<&[(String, Tensor)]>,
    comm: &mut dyn Communicator,
    bucket_bytes: usize,
    st: &mut ipc::IpcState,
) -> Result<(SyncStats, u64)> {
    if let Some(wire) = ipc::negotiate(model, comm, st)? {
        let bucket = match bucket_bytes {
            0 => ipc::DEFAULT_BUCKET_BYTES,
            b => b,
        };
        if let Some(out) = ipc::send(model, comm, wire, bucket, st)? {
            return Ok(out);
        }
    }
    let params = match gathered {
        Some(g) => to_host(g)?,
        None => host_params(model)?,
    };
    let views = views(&params)?;
    let stats = bucketed(bucket_bytes)?
        .send(comm, &views)
        .ctx("sending weights")?;
    Ok((stats, checksum(&views)))
}

/// Receiver side: fills every parameter from rank 0 and installs them in `model`.
pub fn recv_weights(
    model: &Model,
    comm: &mut dyn Communicator,
    bucket_bytes: usize,
    st: &mut ipc::IpcState,
) -> Result<(SyncStats, u64)> {
    if let Some(wire) = ipc::negotiate(model, comm, st)? {
        if let Some(out) = ipc::recv(model, comm, wire, st)? {
            return Ok(out);
        }
    }
    let root = 0;
    let start = Instant::now();
    let mut params = host_params(model)?;
    let mut stats = {
        let mut views: Vec<ParamMut<'_>> = params
            .iter_mut()
            .map(|p| ParamMut::f32(p.name.clone(), &p.shape, &mut p.data))
            .collect::<std::result::Result<_, _>>()?;
        bucketed(bucket_bytes)?
            .recv(comm, root, &mut views)
            .ctx("receiving weights")?
    };
    let sum = checksum(&views(&params)?);
    let device = model.device().clone();
    let tensors: Vec<(String, Tensor)> = params
        .into_iter()
        .map(|p| Ok((p.name, Tensor::from_vec(p.data, p.shape, &device)?)))
        .collect::<Result<_>>()?;
    model
        .set_weights(&tensors)
        .ctx("installing received weights")?;
    stats.elapsed = start.elapsed();
    Ok((stats, sum))
}
