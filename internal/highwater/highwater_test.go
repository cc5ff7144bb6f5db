package highwater

import (
	"sync"
	"testing"
)

func TestMarksKeepTheHighest(t *testing.T) {
	var m Marks
	var wg sync.WaitGroup
	for i := range 100 {
		wg.Go(func() { m.Observe(int64(i), int64(1000-i)) })
	}
	wg.Wait()
	if id, seq := m.Get(); id != 99 || seq != 1000 {
		t.Errorf("Get() = %d, %d after concurrent observations; want 99, 1000", id, seq)
	}
	m.Observe(5, 5)
	if id, seq := m.Get(); id != 99 || seq != 1000 {
		t.Errorf("a lower observation lowered the marks to %d, %d", id, seq)
	}
	var none *Marks
	none.Observe(1, 1)
	if id, seq := none.Get(); id != 0 || seq != 0 {
		t.Errorf("nil Marks: Get() = %d, %d; want zeros", id, seq)
	}
}
