#%Module1.0
## Environment Modules (Tcl) modulefile of liberar; the same as liberar.lua
## for sites without Lmod. Installed by scripts/install as
## PREFIX/modulefiles-tcl/liberar/VERSION with @PREFIX@ and @VERSION@ set.
set prefix  "@PREFIX@"
set version "@VERSION@"

proc ModulesHelp { } {
    puts stderr "liberar @VERSION@: MPI_Allreduce and MPI_Bcast through an eBPF datapath."
    puts stderr "module load liberar, then mpirun as always; erarctl doctor checks a node."
}
module-whatis "liberar $version: in-kernel (eBPF/XDP) MPI collectives, a drop-in LD_PRELOAD"

if { [info exists env(LIBERAR_MPI)] && $env(LIBERAR_MPI) ne "" } {
    set mpi $env(LIBERAR_MPI)
} else {
    set mpi ""
    if { ![catch {exec sh -c "mpirun --version 2>&1"} out] || [info exists out] } {
        if { [string first "Open MPI" $out] >= 0 || [string first "OpenRTE" $out] >= 0 } {
            set mpi openmpi
        } elseif { [string first "HYDRA" $out] >= 0 || [string first "MPICH" $out] >= 0 } {
            set mpi mpich
        }
    }
}
if { [module-info mode load] && $mpi ne "openmpi" && $mpi ne "mpich" } {
    error "liberar: no Open MPI or MPICH `mpirun` on PATH: load your MPI's module first, or set LIBERAR_MPI=openmpi|mpich"
}
setenv LIBERAR_ROOT $prefix
prepend-path PATH $prefix/bin
# Unloading takes back whichever library loading added, even once the MPI
# it was chosen for is gone from PATH.
if { [module-info mode unload] } {
    set mpis {openmpi mpich}
} else {
    set mpis [list $mpi]
}
foreach m $mpis {
    prepend-path LD_PRELOAD $prefix/lib/$m/liberar.so
}
# Ranks inherit LD_PRELOAD from the launcher's node and, under a batch
# system, on every node; Open MPI's mpirun over ssh needs -x LD_PRELOAD
# (see liberar.lua).
