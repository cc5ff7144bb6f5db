package keylock

// NextShare exposes nextShare to the tests of package keylock_test.
func NextShare(claims []Claim, empty, maxKeys, share int) int {
	return nextShare(claims, empty, maxKeys, share)
}
