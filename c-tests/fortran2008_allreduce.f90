! MPI_Allreduce and MPI_Bcast through Fortran 2008's `use mpi_f08` (Open
! MPI only; built for MPI=openmpi).
!
! Why: Open MPI's mpi_f08 bindings (mpi_allreduce_f08_, mpi_bcast_f08_)
! reach the C library through its internal ompi_allreduce_f, never through
! the mpif.h symbols or MPI_Allreduce, so the shim intercepts them by name;
! their handles are TYPE(MPI_Comm) etc. (one INTEGER inside) and ierror is
! OPTIONAL (a null pointer when left out, as some calls here do).
!
! Every rank computes the expected results itself: integer sums exactly,
! dyadic real sums (exact in any order) bitwise, broadcasts bitwise. Rank 0
! prints DIGEST (FNV-1a 64 over all results) and PASS. --quick is accepted.
program fortran2008_allreduce
  use mpi_f08
  implicit none
  integer, parameter :: i8 = selected_int_kind(18)
  ! 100000 elements of 4 bytes = 400 kB: above liberar's thresholds.
  integer, parameter :: n = 100000
  integer :: ierr, rank, nranks, i, r, root
  integer, allocatable :: a(:), b(:)
  real, allocatable :: x(:), y(:)
  integer(i8) :: h

  call MPI_Init(ierr)
  call MPI_Comm_rank(MPI_COMM_WORLD, rank)
  call MPI_Comm_size(MPI_COMM_WORLD, nranks)
  allocate(a(n), b(n), x(n), y(n))
  h = int(z'CBF29CE484222325', i8)

  ! Integer SUM, separate buffers (ierror present) and in place (absent).
  do i = 1, n
    a(i) = ival(rank, i)
  end do
  call MPI_Allreduce(a, b, n, MPI_INTEGER, MPI_SUM, MPI_COMM_WORLD, ierr)
  if (ierr /= MPI_SUCCESS) call fail('MPI_Allreduce returned an error')
  call check_ints(b, 'integer SUM')
  call MPI_Allreduce(MPI_IN_PLACE, a, n, MPI_INTEGER, MPI_SUM, MPI_COMM_WORLD)
  call check_ints(a, 'integer SUM in place')

  ! Dyadic REAL SUM: exact whatever the order.
  do i = 1, n
    x(i) = dyadic(rank, i)
  end do
  call MPI_Allreduce(x, y, n, MPI_REAL, MPI_SUM, MPI_COMM_WORLD, ierr)
  do i = 1, n
    if (y(i) /= sum([(dyadic(r, i), r = 0, nranks - 1)])) call fail('REAL SUM')
    h = fnv(h, int(transfer(y(i), 0), i8))
  end do

  ! Broadcast from the last rank.
  root = nranks - 1
  do i = 1, n
    b(i) = merge(ival(root, i) * 3, -1, rank == root)
  end do
  call MPI_Bcast(b, n, MPI_INTEGER, root, MPI_COMM_WORLD, ierr)
  do i = 1, n
    if (b(i) /= ival(root, i) * 3) call fail('MPI_Bcast')
    h = fnv(h, int(b(i), i8))
  end do

  call MPI_Barrier(MPI_COMM_WORLD)
  if (rank == 0) then
    write(*, '(A,Z16.16)') 'DIGEST ', h
    write(*, '(A)') 'PASS fortran2008_allreduce'
    flush(6)
  end if
  call MPI_Finalize()

contains

  pure integer function ival(rr, ii)
    integer, intent(in) :: rr, ii
    ival = mod(ii * 7919 + rr * 104729, 2000001) - 1000000
  end function

  pure real function dyadic(rr, ii)
    integer, intent(in) :: rr, ii
    dyadic = real(mod(ii * 37 + rr * 101, 16384) - 8192) * 2.0 ** (mod(ii / 1000, 21) - 10)
  end function

  subroutine check_ints(v, what)
    integer, intent(in) :: v(:)
    character(len=*), intent(in) :: what
    integer :: j
    do j = 1, n
      if (v(j) /= sum([(ival(r, j), r = 0, nranks - 1)])) call fail(what)
      h = fnv(h, int(v(j), i8))
    end do
  end subroutine

  ! FNV-1a 64 over the 8 bytes of v, with wrapping multiplication done in
  ! two 32-bit halves (Fortran integers trap or are undefined on overflow).
  pure integer(i8) function fnv(hh, v)
    integer(i8), intent(in) :: hh, v
    integer(i8) :: s, lo, hi, plo, phi
    integer :: k
    s = hh
    do k = 0, 7
      s = ieor(s, iand(ishft(v, -8 * k), 255_i8))
      ! s * 0x100000001b3 mod 2^64 = s * 0x1b3 + (s << 40)
      lo = iand(s, int(z'FFFFFFFF', i8))
      hi = iand(ishft(s, -32), int(z'FFFFFFFF', i8))
      plo = lo * 435_i8
      phi = iand(hi * 435_i8 + ishft(plo, -32) + ishft(lo, 8), int(z'FFFFFFFF', i8))
      s = ior(ishft(phi, 32), iand(plo, int(z'FFFFFFFF', i8)))
    end do
    fnv = s
  end function

  subroutine fail(msg)
    character(len=*), intent(in) :: msg
    write(0, '(A,I0,A,A)') 'FAIL fortran2008_allreduce rank ', rank, ': ', msg
    flush(0)
    call MPI_Abort(MPI_COMM_WORLD, 1)
  end subroutine
end program
