package main

import (
	"slices"
	"time"
)

// cpuSpeed measures how fast one core of the machine is right now: how
// many million integers per second one goroutine sorts, over and over, a
// 2 MiB slice of fixed pseudo-random values (branchy work on data larger than
// a core's L2 cache, closer to a database's than a tight arithmetic loop),
// for about d. The bench runs it at its start and at its end. On a shared
// machine the same code has run twice as fast one hour as the next here (the
// broker ceiling, pure CPU, varied 2x between full runs), so figures from
// two runs compare only at like speeds; within a run, a drop from start to
// end says the machine slowed down under it.
func cpuSpeed(d time.Duration) float64 {
	src := make([]uint64, 256<<10)
	x := uint64(0x9E3779B97F4A7C15)
	for i := range src {
		// xorshift64: the same values on every run.
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		src[i] = x
	}
	buf := make([]uint64, len(src))
	n := 0
	start := time.Now()
	for time.Since(start) < d {
		copy(buf, src)
		slices.Sort(buf)
		n += len(buf)
	}
	return float64(n) / time.Since(start).Seconds() / 1e6
}
