! MPI_ALLREDUCE and MPI_BCAST through the Fortran bindings (`use mpi`).
!
! Why a Fortran test: Open MPI's Fortran bindings call PMPI_Allreduce
! directly (a C-only MPI_Allreduce never sees them), MPICH's call the C
! symbol, and Fortran MPI_IN_PLACE is the address of a common block, not the
! C constant. The shim must get all of that right.
!
! Every rank's input is a function of (rank, index, case), so every rank
! computes the expected result itself. Integer sums are checked exactly,
! real sums of realistic data against the bound any ordered summation
! meets, (n-1)*eps*sum|x|; dyadic real sums (exact in any order) bitwise.
! Rank 0 prints DIGEST (FNV-1a 64 over the order-independent results) and
! PASS. Optional argument --quick is accepted (sizes are already small).
program fortran_allreduce
  use mpi
  implicit none
  integer, parameter :: dp = kind(1.0d0)
  integer, parameter :: i8 = selected_int_kind(18)
  integer :: ierr, rank, nranks, k, nsizes
  integer :: sizes(3)
  integer(i8) :: dig_hi, dig_lo
  character(len=32) :: arg

  call MPI_INIT(ierr)
  call MPI_COMM_RANK(MPI_COMM_WORLD, rank, ierr)
  call MPI_COMM_SIZE(MPI_COMM_WORLD, nranks, ierr)
  do k = 1, command_argument_count()
    call get_command_argument(k, arg)
    if (trim(arg) /= '--quick' .and. trim(arg) /= '-q') then
      if (rank == 0) write(0, '(A)') 'usage: fortran_allreduce [--quick]'
      call MPI_ABORT(MPI_COMM_WORLD, 2, ierr)
    end if
  end do

  dig_hi = int(z'CBF29CE4', i8)
  dig_lo = int(z'84222325', i8)

  ! 100000 elements of 4 bytes = 400 kB: above liberar's 256 KiB threshold.
  sizes = [1, 1001, 100000]
  nsizes = 3
  do k = 1, nsizes
    call test_int_sum(sizes(k), .false., 10 * k)
    call test_int_sum(sizes(k), .true., 10 * k + 1)
    call test_real_sum(sizes(k), .false., .false., 10 * k + 2)
    call test_real_sum(sizes(k), .true., .false., 10 * k + 3)
    call test_real_sum(sizes(k), .false., .true., 10 * k + 4)
    call test_real_sum(sizes(k), .true., .true., 10 * k + 5)
  end do
  call test_bcast_int(100000, 0, 100)
  call test_bcast_int(100000, nranks - 1, 101)
  call test_bcast_int(1, nranks / 2, 102)
  call test_bcast_real(70001, nranks / 2, 103)

  call MPI_BARRIER(MPI_COMM_WORLD, ierr)
  if (rank == 0) then
    write(*, '(A,A)') 'DIGEST ', hex16(dig_hi, dig_lo)
    write(*, '(A)') 'PASS fortran_allreduce'
    flush(6)
  end if
  call MPI_FINALIZE(ierr)

contains

  ! ---------------------------------------------------------------- inputs

  pure integer function int_input(r, i, c)
    integer, intent(in) :: r, i, c
    ! |value| <= 10^6: sums of thousands of ranks stay far from overflow.
    int_input = int(mod(int(i, i8) * 7919_i8 + int(r, i8) * 104729_i8 + int(c, i8) * 31_i8, &
                        2000001_i8) - 1000000_i8)
  end function

  ! Realistic data: smooth in i, different per rank, one decade per block of
  ! 1000 elements from 1e-3 to 1e3.
  pure real function real_input(r, i, c)
    integer, intent(in) :: r, i, c
    real(dp) :: scale
    scale = 10.0_dp ** (mod(i / 1000 + c, 7) - 3)
    real_input = real(sin(real(r * 7 + i, dp) + 0.1_dp * c) * scale)
  end function

  ! Dyadic data k * 2^e (|k| < 2^13, e shared by all ranks): float sums of a
  ! few thousand ranks are exact in any order.
  pure real function dyadic_input(r, i, c)
    integer, intent(in) :: r, i, c
    integer :: kk
    kk = mod(i * 37 + r * 101 + c, 16384) - 8192
    dyadic_input = real(kk) * 2.0 ** (mod(i / 1000, 21) - 10)
  end function

  ! ---------------------------------------------------------------- checks

  subroutine fail(msg)
    character(len=*), intent(in) :: msg
    integer :: e
    write(0, '(A,I0,A,A)') 'FAIL fortran_allreduce rank ', rank, ': ', trim(msg)
    flush(0)
    call MPI_ABORT(MPI_COMM_WORLD, 1, e)
  end subroutine

  ! All ranks must hold bitwise identical results: gather each rank's hash
  ! with MPI_ALLGATHER (not an allreduce, which would go through the shim).
  subroutine check_same(hi, lo, what)
    integer(i8), intent(in) :: hi, lo
    character(len=*), intent(in) :: what
    integer(i8) :: mine(2)
    integer(i8), allocatable :: all(:, :)
    integer :: r, e
    allocate(all(2, 0:nranks - 1))
    mine = [hi, lo]
    call MPI_ALLGATHER(mine, 2, MPI_INTEGER8, all, 2, MPI_INTEGER8, MPI_COMM_WORLD, e)
    do r = 0, nranks - 1
      if (all(1, r) /= hi .or. all(2, r) /= lo) then
        call fail(what // ': result differs between ranks (not bitwise identical)')
      end if
    end do
    deallocate(all)
  end subroutine

  ! FNV-1a 64 on two 32-bit halves held in 64-bit integers, so no step can
  ! overflow (signed overflow is undefined in Fortran): prime = 2^40 + 435.
  subroutine fnv_byte(hi, lo, b)
    integer(i8), intent(inout) :: hi, lo
    integer(i8), intent(in) :: b
    integer(i8), parameter :: m32 = int(z'FFFFFFFF', i8), m24 = int(z'FFFFFF', i8)
    integer(i8) :: tlo, thi
    lo = ieor(lo, b)
    tlo = lo * 435_i8
    thi = hi * 435_i8 + ishft(tlo, -32) + ishft(iand(lo, m24), 8)
    lo = iand(tlo, m32)
    hi = iand(thi, m32)
  end subroutine

  subroutine fnv_word(hi, lo, v)
    integer(i8), intent(inout) :: hi, lo
    integer, intent(in) :: v
    integer :: j
    do j = 0, 3
      call fnv_byte(hi, lo, iand(ishft(int(v, i8), -8 * j), 255_i8))
    end do
  end subroutine

  subroutine hash_ints(hi, lo, a, n)
    integer(i8), intent(inout) :: hi, lo
    integer, intent(in) :: n, a(n)
    integer :: i
    do i = 1, n
      call fnv_word(hi, lo, a(i))
    end do
  end subroutine

  subroutine hash_reals(hi, lo, a, n)
    integer(i8), intent(inout) :: hi, lo
    integer, intent(in) :: n
    real, intent(in) :: a(n)
    integer :: i
    do i = 1, n
      call fnv_word(hi, lo, transfer(a(i), 0))
    end do
  end subroutine

  function hex16(hi, lo) result(s)
    integer(i8), intent(in) :: hi, lo
    character(len=16) :: s
    character(len=16), parameter :: digits = '0123456789abcdef'
    integer :: j
    do j = 0, 7
      s(8 - j:8 - j) = digits(int(iand(ishft(hi, -4 * j), 15_i8)) + 1:int(iand(ishft(hi, -4 * j), 15_i8)) + 1)
      s(16 - j:16 - j) = digits(int(iand(ishft(lo, -4 * j), 15_i8)) + 1:int(iand(ishft(lo, -4 * j), 15_i8)) + 1)
    end do
  end function

  function label(kind, n, in_place, c) result(s)
    character(len=*), intent(in) :: kind
    integer, intent(in) :: n, c
    logical, intent(in) :: in_place
    character(len=96) :: s
    write(s, '(A,A,I0,A,L1,A,I0)') kind, ' n=', n, ' in_place=', in_place, ' case=', c
  end function

  ! Adds a deterministic result to the digest (label first, as in C).
  subroutine digest_label(s)
    character(len=*), intent(in) :: s
    integer :: j
    do j = 1, len_trim(s)
      call fnv_byte(dig_hi, dig_lo, int(ichar(s(j:j)), i8))
    end do
  end subroutine

  ! ---------------------------------------------------------------- tests

  subroutine test_int_sum(n, in_place, c)
    integer, intent(in) :: n, c
    logical, intent(in) :: in_place
    integer, allocatable :: sbuf(:), rbuf(:), copy(:)
    integer :: i, r, e
    integer(i8) :: want, hi, lo
    character(len=96) :: what
    character(len=200) :: msg
    what = label('allreduce INTEGER SUM', n, in_place, c)
    allocate(sbuf(n), rbuf(n), copy(n))
    do i = 1, n
      sbuf(i) = int_input(rank, i, c)
    end do
    copy = sbuf
    if (in_place) then
      rbuf = sbuf
      call MPI_ALLREDUCE(MPI_IN_PLACE, rbuf, n, MPI_INTEGER, MPI_SUM, MPI_COMM_WORLD, e)
    else
      rbuf = -559038737
      call MPI_ALLREDUCE(sbuf, rbuf, n, MPI_INTEGER, MPI_SUM, MPI_COMM_WORLD, e)
      if (any(sbuf /= copy)) call fail(trim(what) // ': send buffer modified')
    end if
    if (e /= MPI_SUCCESS) call fail(trim(what) // ': MPI_ALLREDUCE failed')
    do i = 1, n
      want = 0
      do r = 0, nranks - 1
        want = want + int_input(r, i, c)
      end do
      if (int(rbuf(i), i8) /= want) then
        write(msg, '(A,A,I0,A,I0,A,I0)') trim(what), ': element ', i, ' got ', rbuf(i), ' expected ', want
        call fail(msg)
      end if
    end do
    hi = 0
    lo = 0
    call hash_ints(hi, lo, rbuf, n)
    call check_same(hi, lo, trim(what))
    call digest_label(trim(what))
    call hash_ints(dig_hi, dig_lo, rbuf, n)
    deallocate(sbuf, rbuf, copy)
  end subroutine

  subroutine test_real_sum(n, in_place, dyadic, c)
    integer, intent(in) :: n, c
    logical, intent(in) :: in_place, dyadic
    real, allocatable :: sbuf(:), rbuf(:), copy(:)
    integer :: i, r, e
    real(dp) :: exact, abssum, x, bound
    integer(i8) :: hi, lo
    character(len=96) :: what
    character(len=240) :: msg
    if (dyadic) then
      what = label('allreduce REAL SUM dyadic', n, in_place, c)
    else
      what = label('allreduce REAL SUM real', n, in_place, c)
    end if
    allocate(sbuf(n), rbuf(n), copy(n))
    do i = 1, n
      if (dyadic) then
        sbuf(i) = dyadic_input(rank, i, c)
      else
        sbuf(i) = real_input(rank, i, c)
      end if
    end do
    copy = sbuf
    if (in_place) then
      rbuf = sbuf
      call MPI_ALLREDUCE(MPI_IN_PLACE, rbuf, n, MPI_REAL, MPI_SUM, MPI_COMM_WORLD, e)
    else
      rbuf = -1.0e30
      call MPI_ALLREDUCE(sbuf, rbuf, n, MPI_REAL, MPI_SUM, MPI_COMM_WORLD, e)
      if (any(transfer(sbuf, 0, n) /= transfer(copy, 0, n))) call fail(trim(what) // ': send buffer modified')
    end if
    if (e /= MPI_SUCCESS) call fail(trim(what) // ': MPI_ALLREDUCE failed')
    do i = 1, n
      exact = 0
      abssum = 0
      do r = 0, nranks - 1
        if (dyadic) then
          x = real(dyadic_input(r, i, c), dp)
        else
          x = real(real_input(r, i, c), dp)
        end if
        exact = exact + x
        abssum = abssum + abs(x)
      end do
      if (dyadic) then
        ! Exact in double and in single precision, in any order.
        if (real(exact) /= rbuf(i)) then
          write(msg, '(A,A,I0,A,ES16.8,A,ES16.8)') trim(what), ': element ', i, ' got ', rbuf(i), &
              ' expected exactly ', exact
          call fail(msg)
        end if
      else
        ! The double reference is off by at most n*2^-53*sum|x|: 2^-29 of
        ! the bound, so the bound is not loosened in any way that matters.
        bound = (nranks - 1) * real(epsilon(1.0), dp) * abssum + nranks * real(tiny(1.0), dp)
        if (abs(real(rbuf(i), dp) - exact) > bound .or. rbuf(i) /= rbuf(i)) then
          write(msg, '(A,A,I0,A,ES16.8,A,ES16.8,A,ES10.3)') trim(what), ': element ', i, ' got ', rbuf(i), &
              ' expected ', exact, ' bound ', bound
          call fail(msg)
        end if
      end if
    end do
    hi = 0
    lo = 0
    call hash_reals(hi, lo, rbuf, n)
    call check_same(hi, lo, trim(what))
    if (dyadic) then
      call digest_label(trim(what))
      call hash_reals(dig_hi, dig_lo, rbuf, n)
    end if
    deallocate(sbuf, rbuf, copy)
  end subroutine

  subroutine test_bcast_int(n, root, c)
    integer, intent(in) :: n, root, c
    integer, allocatable :: buf(:)
    integer :: i, e
    character(len=96) :: what
    character(len=200) :: msg
    write(what, '(A,I0,A,I0)') 'bcast INTEGER n=', n, ' root=', root
    allocate(buf(n))
    do i = 1, n
      if (rank == root) then
        buf(i) = int_input(root, i, c)
      else
        buf(i) = -1
      end if
    end do
    call MPI_BCAST(buf, n, MPI_INTEGER, root, MPI_COMM_WORLD, e)
    if (e /= MPI_SUCCESS) call fail(trim(what) // ': MPI_BCAST failed')
    do i = 1, n
      if (buf(i) /= int_input(root, i, c)) then
        write(msg, '(A,A,I0,A,I0,A,I0)') trim(what), ': element ', i, ' got ', buf(i), &
            ' expected ', int_input(root, i, c)
        call fail(msg)
      end if
    end do
    call digest_label(trim(what))
    call hash_ints(dig_hi, dig_lo, buf, n)
    deallocate(buf)
  end subroutine

  subroutine test_bcast_real(n, root, c)
    integer, intent(in) :: n, root, c
    real, allocatable :: buf(:)
    integer :: i, e
    character(len=96) :: what
    character(len=200) :: msg
    write(what, '(A,I0,A,I0)') 'bcast REAL n=', n, ' root=', root
    allocate(buf(n))
    do i = 1, n
      if (rank == root) then
        buf(i) = real_input(root, i, c)
      else
        buf(i) = 0
      end if
    end do
    call MPI_BCAST(buf, n, MPI_REAL, root, MPI_COMM_WORLD, e)
    if (e /= MPI_SUCCESS) call fail(trim(what) // ': MPI_BCAST failed')
    do i = 1, n
      if (transfer(buf(i), 0) /= transfer(real_input(root, i, c), 0)) then
        write(msg, '(A,A,I0,A,ES16.8)') trim(what), ': element ', i, ' got ', buf(i)
        call fail(msg)
      end if
    end do
    call digest_label(trim(what))
    call hash_reals(dig_hi, dig_lo, buf, n)
    deallocate(buf)
  end subroutine

end program fortran_allreduce
