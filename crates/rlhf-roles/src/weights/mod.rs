//! Weight lists for sync and checksums: every parameter of a model as host f32, in the
//! model's parameter order, on both sides of a sync. When every rank of a sync computes on a
//! GPU of one node the weights go through the trainer's GPU memory instead ([`ipc`]); the
//! ranks agree on that at the start of every sync.

pub mod ipc;

use std::time::Instant;

use candle_core::{DType, Tensor};
use rlhf_collective::{
    checksum, BucketedSync, Communicator, Param, ParamMeta, ParamMut, ParamView, SendStream,
    SyncStats,
};
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
/// `Zero3::gathered_checksum`'s.
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
    if let Some(wire) = ipc::negotiate(model, comm, st)? {
        let bucket = match bucket_bytes {
            0 => ipc::DEFAULT_BUCKET_BYTES,
            b => b,
        };
        if let Some(out) = ipc::send(model, comm, wire, bucket, st)? {
            return Ok(out);
        }
    }
    let params = host_params(model)?;
    let views = views(&params)?;
    let stats = bucketed(bucket_bytes)?
        .send(comm, &views)
        .ctx("sending weights")?;
    Ok((stats, checksum(&views)))
}

/// The root side of the weight sync of a ZeRO-3 model, from rank 0 of its data-parallel
/// group (`dp`, lent to the model): the group gathers the whole weights a decoder layer at a
/// time and each parameter is sent as soon as it is gathered, so rank 0 holds the edges
/// (embeddings, heads) and one layer, never the whole policy. The other ranks of the group
/// take part in the same gathers ([`rlhf_model::zero3::Zero3::gather_all_for_others`]). By the
/// host path (a sharded model offers no CUDA IPC, so the ranks agree on that). The same wire
/// and checksum as [`send_weights`].
///
/// The outer error: a gather failed (the group is broken, and so is the half-sent sync); the
/// inner one: the sync failed, after this rank took part in every gather all the same, so
/// the rest of the group is not left waiting (the receivers may be, mid-sync: the weights
/// group is not to be used again).
pub fn send_weights_sharded(
    model: &Model,
    dp: &mut dyn Communicator,
    comm: &mut dyn Communicator,
    bucket_bytes: usize,
    st: &mut ipc::IpcState,
) -> Result<Result<(SyncStats, u64)>> {
    let z = model.zero3().ok_or_else(|| {
        crate::Error::internal("a sharded weight sync of a model that is not sharded")
    })?;
    let mut failed = None;
    let mut stream = start_sharded_sync(model, z, comm, bucket_bytes, st)
        .map_err(|e| failed = Some(e))
        .ok();
    crate::zero::lend(model, dp, |_| {
        Ok(z.gather_each_host(|name, t| {
            let Some(s) = stream.as_mut() else {
                // The sync failed: the gathers go on for the other ranks' sake.
                return Ok(());
            };
            let sent = (|| -> Result<()> {
                let data = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                let p = Param::f32(name.clone(), t.dims(), &data)?;
                s.push(&name, p.data()).ctx("sending weights")
            })();
            if let Err(e) = sent {
                failed = Some(e);
                stream = None;
            }
            Ok(())
        })?)
    })
    .ctx("gathering the sharded weights (training.zero_stage 3)")?;
    Ok(match (failed, stream) {
        (Some(e), _) => Err(e),
        (None, Some(s)) => s.finish().ctx("sending weights"),
        (None, None) => Err(crate::Error::internal(
            "the sharded weight sync lost its stream",
        )),
    })
}

/// The start of [`send_weights_sharded`]'s sync: the path agreed (the host's) and the
/// manifest checked with the receivers.
fn start_sharded_sync<'c>(
    model: &Model,
    z: &rlhf_model::zero3::Zero3,
    comm: &'c mut (dyn Communicator + 'c),
    bucket_bytes: usize,
    st: &mut ipc::IpcState,
) -> Result<SendStream<'c, dyn Communicator + 'c>> {
    let params: Vec<ParamMeta> = z
        .param_shapes()?
        .into_iter()
        .map(|(name, shape)| ParamMeta::new(name, &shape, rlhf_collective::DType::F32))
        .collect();
    let sync = bucketed(bucket_bytes)?;
    if ipc::negotiate(model, comm, st)?.is_some() {
        return Err(crate::Error::internal(
            "the ranks agreed on CUDA IPC for a sharded model's sync",
        ));
    }
    sync.send_stream(comm, params).ctx("sending weights")
}

/// A ZeRO-3 trainer rank's part in the gathers of a weight sync (or of a save) that another
/// rank of its data-parallel group (`dp`) keeps: the same collectives, each gathered layer
/// dropped at once. Also what rank 0 does when it cannot send at all, so the other ranks are
/// not left waiting in their gathers.
pub fn gather_for_others(model: &Model, dp: &mut dyn Communicator) -> Result<()> {
    let z = model
        .zero3()
        .ok_or_else(|| crate::Error::internal("sharded gathers of a model that is not sharded"))?;
    crate::zero::lend(model, dp, |_| Ok(z.gather_all_for_others()?))
        .ctx("gathering the sharded weights (training.zero_stage 3)")
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
