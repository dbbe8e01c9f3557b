//! A broadcast's buffer as one string of bytes, whatever its datatype: the
//! layout of a datatype the datapath does not know ([`type_layout`]: dense,
//! or packed), and the packing of such a buffer through PMPI_Pack and
//! PMPI_Unpack ([`Packing`]).

use crate::ffi::{MPI_Comm, MPI_Count, MPI_Datatype, MPI_SUCCESS};
use crate::rt::{pmpi, Runtime};
use liberar::datapath::DatapathError;
use std::ops::Range;
use std::os::raw::{c_int, c_void};

/// How the datapath gets a broadcast's data as one string of bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// The buffer holds the bytes as they are.
    Dense,
    /// Packed into (root) and unpacked from (others) a bounce buffer with
    /// PMPI_Pack/PMPI_Unpack: holes, a lower bound, a resized extent,
    /// MPI_BOTTOM with absolute addresses. `size` bytes per element,
    /// elements `extent` bytes apart.
    Packed { size: usize, extent: isize },
}

/// (bytes, layout) of `count > 0` elements of a datatype that is not in the
/// table; `None` if MPI rejects the datatype or the size overflows (both
/// erroneous). The layout is `None` when the datapath cannot move it (size
/// 0, beyond MPI_Count, or elements PMPI_Pack cannot take one at a time).
pub unsafe fn type_layout(dt: MPI_Datatype, count: c_int) -> Option<(usize, Option<Layout>)> {
    let p = pmpi();
    let (mut size, mut lb, mut extent, mut tlb, mut textent): (
        MPI_Count,
        MPI_Count,
        MPI_Count,
        MPI_Count,
        MPI_Count,
    ) = (0, 0, 0, 0, 0);
    if p.PMPI_Type_size_x(dt, &mut size) != MPI_SUCCESS
        || p.PMPI_Type_get_extent_x(dt, &mut lb, &mut extent) != MPI_SUCCESS
        || p.PMPI_Type_get_true_extent_x(dt, &mut tlb, &mut textent) != MPI_SUCCESS
    {
        return None;
    }
    let Ok(usize_size) = usize::try_from(size) else {
        // MPI_UNDEFINED: a size beyond MPI_Count.
        return Some((0, None));
    };
    // Overflow: more bytes than memory holds, erroneous (MPI reports it).
    let bytes = usize::try_from(count).ok()?.checked_mul(usize_size)?;
    if usize_size == 0 {
        return Some((0, None));
    }
    if lb == 0 && tlb == 0 && extent == size && textent == size {
        return Some((bytes, Some(Layout::Dense)));
    }
    // PMPI_Pack takes at most c_int bytes per element.
    let packable = size <= MPI_Count::from(c_int::MAX);
    let layout = isize::try_from(extent)
        .ok()
        .filter(|_| packable)
        .map(|extent| Layout::Packed {
            size: usize_size,
            extent,
        });
    Some((bytes, layout))
}

/// One broadcast's buffer as seen by PMPI_Pack/PMPI_Unpack.
pub struct Packing<'a> {
    pub rt: &'a Runtime,
    /// The caller's buffer (null for MPI_BOTTOM).
    pub buf: *mut c_void,
    pub count: usize,
    pub datatype: MPI_Datatype,
    pub comm: MPI_Comm,
    pub size: usize,
    pub extent: isize,
}

impl Packing<'_> {
    /// Elements per PMPI_Pack/PMPI_Unpack call (their sizes are C ints).
    fn per_call(&self) -> usize {
        (c_int::MAX as usize / self.size).max(1)
    }

    /// The caller's element `i` (plain address arithmetic: MPI_BOTTOM is
    /// null and the datatype holds absolute addresses).
    fn element(&self, i: usize) -> *mut c_void {
        self.buf
            .cast::<u8>()
            .wrapping_offset((i as isize).wrapping_mul(self.extent))
            .cast()
    }

    /// The communicator PMPI_Pack/PMPI_Unpack report errors on: the probe
    /// communicator (MPI_ERRORS_RETURN), else the caller's.
    fn err_comm(&self) -> MPI_Comm {
        self.rt.probe_comm().unwrap_or(self.comm)
    }

    /// Calls `call(first element, elements, byte range, &mut position)` on
    /// the buffer in pieces of at most [`Self::per_call`] elements, the byte
    /// range being theirs in the packed string; each call must return
    /// MPI_SUCCESS with `position` at the end of its range (`what` names the
    /// call in the error).
    fn in_pieces(
        &self,
        what: &str,
        mut call: impl FnMut(usize, usize, Range<usize>, &mut c_int) -> c_int,
    ) -> Result<(), DatapathError> {
        let mut done = 0;
        while done < self.count {
            let k = self.per_call().min(self.count - done);
            let piece = done * self.size..(done + k) * self.size;
            let len = piece.len();
            let mut position: c_int = 0;
            let rc = call(done, k, piece, &mut position);
            if rc != MPI_SUCCESS || position as usize != len {
                return Err(DatapathError::Failed(format!(
                    "{what} of {k} elements returned {rc}, {position} of {len} bytes"
                )));
            }
            done += k;
        }
        Ok(())
    }

    /// The caller's `count` elements, packed into `out` (`count * size` bytes).
    pub unsafe fn pack(&self, out: &mut [u8]) -> Result<(), DatapathError> {
        let comm = self.err_comm();
        self.in_pieces("MPI_Pack", |first, k, piece, position| {
            let piece = &mut out[piece];
            pmpi().PMPI_Pack(
                self.element(first).cast_const(),
                k as c_int,
                self.datatype,
                piece.as_mut_ptr().cast(),
                piece.len() as c_int,
                position,
                comm,
            )
        })
    }

    /// The reverse of [`Self::pack`]: `data` into the caller's elements.
    pub unsafe fn unpack(&self, data: &[u8]) -> Result<(), DatapathError> {
        let comm = self.err_comm();
        self.in_pieces("MPI_Unpack", |first, k, piece, position| {
            let piece = &data[piece];
            pmpi().PMPI_Unpack(
                piece.as_ptr().cast(),
                piece.len() as c_int,
                position,
                self.element(first),
                k as c_int,
                self.datatype,
                comm,
            )
        })
    }
}
