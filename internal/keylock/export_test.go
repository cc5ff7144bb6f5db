package keylock

// IsDeadlock exposes isDeadlock to the tests of package keylock_test.
var IsDeadlock = isDeadlock

// NextShare exposes nextShare to the tests of package keylock_test.
func NextShare(claims []Claim, empty, maxKeys, share int) int {
	return nextShare(claims, empty, maxKeys, share)
}

// LockFree exposes lockFree to the tests of package keylock_test.
func LockFree(claims []Claim, out Outcome) bool { return lockFree(claims, out) }
