-- Lmod modulefile of liberar (installed by scripts/install as
-- PREFIX/modulefiles/liberar/VERSION.lua, with @PREFIX@ and @VERSION@ set).
-- `module load liberar` preloads the library built for the MPI on PATH into
-- every rank of the jobs that follow; `module unload liberar` takes back
-- every variable it set.
local prefix = "@PREFIX@"
local version = "@VERSION@"

help([[
liberar @VERSION@: MPI_Allreduce and MPI_Bcast on large buffers through an
eBPF datapath in the kernel, for unmodified Open MPI and MPICH jobs.

  module load liberar        (after the MPI's own module, if it has one)
  mpirun ...                 (as always)
  erarctl doctor             (is this node ready for me?)

The MPI is told from `mpirun --version`; LIBERAR_MPI=openmpi|mpich set
before loading overrides it. Open MPI's mpirun launching over ssh (no batch
system) needs `-x LD_PRELOAD`. Documentation: @PREFIX@/share/doc/liberar/
]])
whatis("Name: liberar")
whatis("Version: " .. version)
whatis("Description: in-kernel (eBPF/XDP) MPI collectives, a drop-in LD_PRELOAD")

local mpi = os.getenv("LIBERAR_MPI")
if mpi == nil or mpi == "" then
  local out = capture("mpirun --version 2>&1") or ""
  if out:find("Open MPI", 1, true) or out:find("OpenRTE", 1, true) then
    mpi = "openmpi"
  elseif out:find("HYDRA", 1, true) or out:find("MPICH", 1, true) then
    mpi = "mpich"
  end
end
if mode() == "load" and mpi ~= "openmpi" and mpi ~= "mpich" then
  LmodError("liberar: no Open MPI or MPICH `mpirun` on PATH: load your MPI's module " ..
            "first, or set LIBERAR_MPI=openmpi|mpich")
end

setenv("LIBERAR_ROOT", prefix)
prepend_path("PATH", pathJoin(prefix, "bin"))
-- Unloading takes back whichever library loading added, even once the MPI
-- it was chosen for is gone from PATH (prepend_path removes on unload).
local mpis = { mpi }
if mode() == "unload" then
  mpis = { "openmpi", "mpich" }
end
for _, m in ipairs(mpis) do
  prepend_path("LD_PRELOAD", pathJoin(prefix, "lib", m, "liberar.so"))
end
-- Ranks inherit LD_PRELOAD from the launcher on the node it runs on, and
-- under a batch system (Slurm, PBS) on every node; hydra (MPICH) forwards
-- the environment to ssh-launched nodes itself. Open MPI's mpirun over ssh
-- needs `-x LD_PRELOAD`: setting OMPI_MCA_mca_base_env_list here instead
-- would make every job that passes its own `-x` fail (Open MPI refuses the
-- two together).
