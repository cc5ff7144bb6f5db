// Package highwater remembers the highest deferred_message id and seq a
// process has seen, so that a database that went back in time (a failover to
// a lagging replica, a restore) can be moved past them before it hands them
// out again.
//
// The ids are the defer.id of every published message, and consumers dedupe
// on them: after a rewind, the sequences would draw again ids that messages
// published since the restore point carried, and give them to other
// messages. Ingest passes the marks to its insert, and the heartbeat to its
// beat, and both move the sequences past them where they are behind
// (deferred_sequences_advance, migration 0005). The marks grow from what
// ingest stores, what dispatch claims, and the sequences' values the
// heartbeat reads back every second.
//
// What this cannot cover: ids handed out in the last second before a
// rewind by another process that is not running when the database comes
// back, before anything it published was seen here; see the README's
// "High availability".
package highwater

import "sync/atomic"

// Marks holds the highest id and seq seen. The zero value is ready, and a
// nil *Marks observes nothing and reports zeros. Safe for concurrent use.
type Marks struct {
	id, seq atomic.Int64
}

// Observe raises the marks to id and seq where they are higher.
func (m *Marks) Observe(id, seq int64) {
	if m == nil {
		return
	}
	raise(&m.id, id)
	raise(&m.seq, seq)
}

// Get returns the highest id and seq seen.
func (m *Marks) Get() (id, seq int64) {
	if m == nil {
		return 0, 0
	}
	return m.id.Load(), m.seq.Load()
}

func raise(a *atomic.Int64, v int64) {
	for {
		cur := a.Load()
		if v <= cur || a.CompareAndSwap(cur, v) {
			return
		}
	}
}
