package protocol

// Partition returns the partition, of partitions, that the Java client's
// default partitioner (and sarama's NewMurmur2Partitioner) picks for a
// record whose key is key: murmur2 of the key, made positive, modulo the
// partition count. The scheduler and the client library use it to put every
// record of a business key on one partition, of scheduler.defer and of the
// retry topic, whatever the record key: per-key order is partition order.
// partitions must be positive.
func Partition(key []byte, partitions int32) int32 {
	return int32(uint32(murmur2(key)&0x7fffffff) % uint32(partitions))
}

// murmur2 is the Java client's Utils.murmur2, with its seed and constants.
func murmur2(data []byte) int32 {
	const (
		seed uint32 = 0x9747b28c
		m    uint32 = 0x5bd1e995
		r           = 24
	)
	n := len(data)
	h := seed ^ uint32(n)
	for i := 0; i+4 <= n; i += 4 {
		k := uint32(data[i]) | uint32(data[i+1])<<8 | uint32(data[i+2])<<16 | uint32(data[i+3])<<24
		k *= m
		k ^= k >> r
		k *= m
		h *= m
		h ^= k
	}
	tail := n &^ 3
	switch n & 3 {
	case 3:
		h ^= uint32(data[tail+2]) << 16
		fallthrough
	case 2:
		h ^= uint32(data[tail+1]) << 8
		fallthrough
	case 1:
		h ^= uint32(data[tail])
		h *= m
	}
	h ^= h >> 13
	h *= m
	h ^= h >> 15
	return int32(h)
}
