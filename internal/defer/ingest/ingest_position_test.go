package ingest

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/deferq/scheduler/internal/highwater"
	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/internal/pgtest"
)

// commitOffset commits offset for group on partition p of the defer topic,
// as a member of the group would: in a session of its own.
func (k *kafkaEnv) commitOffset(t *testing.T, group string, p int32, offset int64) {
	t.Helper()
	cg, err := sarama.NewConsumerGroup(k.addrs, group, saramaConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer cg.Close()
	h := &committer{partition: p, offset: offset, done: make(chan struct{})}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go cg.Consume(ctx, []string{ingestTopic}, h)
	select {
	case <-h.done:
	case <-time.After(20 * time.Second):
		t.Fatal("no consumer-group session to commit in")
	}
	cancel()
	if got := k.committed(t, group)[p]; got != offset {
		t.Fatalf("committed offset of partition %d = %d, want %d", p, got, offset)
	}
}

// committer commits one offset in Setup and consumes nothing.
type committer struct {
	partition int32
	offset    int64
	done      chan struct{}
}

func (c *committer) Setup(sess sarama.ConsumerGroupSession) error {
	sess.MarkOffset(ingestTopic, c.partition, c.offset, "")
	sess.ResetOffset(ingestTopic, c.partition, c.offset, "")
	sess.Commit()
	close(c.done)
	return nil
}
func (c *committer) Cleanup(sarama.ConsumerGroupSession) error { return nil }
func (c *committer) ConsumeClaim(sess sarama.ConsumerGroupSession, _ sarama.ConsumerGroupClaim) error {
	<-sess.Context().Done()
	return nil
}

// offsetsStored returns the source offsets stored for partition p, in
// order, with their epochs.
func offsetsStored(t *testing.T, pool *pgxpool.Pool, p int32) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(),
		"SELECT source_epoch, source_offset FROM deferred_message WHERE source_partition = $1 ORDER BY source_epoch, source_offset", p)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var e int32
		var o int64
		if err := rows.Scan(&e, &o); err != nil {
			t.Fatal(err)
		}
		out = append(out, fmt.Sprintf("%d:%d", e, o))
	}
	return out
}

// slicesWithout returns s without the elements of drop.
func slicesWithout(s, drop []string) []string {
	d := map[string]bool{}
	for _, x := range drop {
		d[x] = true
	}
	var out []string
	for _, x := range s {
		if !d[x] {
			out = append(out, x)
		}
	}
	return out
}

// span renders offsets from..to (inclusive) of epoch e as offsetsStored does.
func epochSpan(e int32, from, to int64) []string {
	var out []string
	for o := from; o <= to; o++ {
		out = append(out, fmt.Sprintf("%d:%d", e, o))
	}
	return out
}

// waitPosition waits until partition p's stored position is next.
func waitPosition(t *testing.T, store *Store, p int32, next int64) StoredPosition {
	t.Helper()
	var sp StoredPosition
	waitFor(t, 30*time.Second, fmt.Sprintf("partition %d stored up to %d", p, next), func() (bool, string) {
		got, err := store.Positions(context.Background(), ingestTopic, []int32{p})
		if err != nil {
			t.Fatal(err)
		}
		sp = got[p]
		return sp.Next == next, fmt.Sprintf("position %+v", got)
	})
	return sp
}

func counter(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	return gatherIngest(t, reg)[name]
}

// A claim starts at the position stored with the rows, whether it is behind
// the group's committed offset (Postgres went back: the records in between
// are read again), equal to it, or ahead of it (the offsets' commit was lost
// in a crash: the records in between are stored, and may be dispatched
// already); with no position stored, at the log start.
func TestIngestStartsAtStoredPosition(t *testing.T) {
	tests := []struct {
		name      string
		stored    int64 // NoPosition: none
		committed int64 // NoPosition: none
		reread    float64
	}{
		{"behind the committed offset", 10, 25, 15},
		{"at the committed offset", 10, 10, 0},
		{"ahead of the committed offset", 25, 10, 0},
		{"ahead, nothing committed", 25, NoPosition, 0},
		{"none stored, offsets committed", NoPosition, 25, 25},
		{"none stored, nothing committed", NoPosition, NoPosition, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			k := newKafka(t)
			store := NewStore(db.Pool, nil)
			group := "start-" + strings.ReplaceAll(tt.name, " ", "-")
			var recs []*sarama.ProducerMessage
			for i := range 30 {
				recs = append(recs, validRec(0, fmt.Sprint("k-", i), "v"))
			}
			k.produce(t, recs...)
			if tt.committed != NoPosition {
				k.commitOffset(t, group, 0, tt.committed)
			}
			if tt.stored != NoPosition {
				none := Position{Topic: ingestTopic, Partition: 0, Next: NoPosition}
				if err := store.SetPosition(t.Context(), none, Position{Topic: ingestTopic, Partition: 0, Next: tt.stored}, ""); err != nil {
					t.Fatal(err)
				}
			}
			reg := prometheus.NewRegistry()
			startIngester(t.Context(), t, k, db.Pool, group, IngestConfig{BatchSize: 7, BatchLinger: 10 * time.Millisecond,
				Metrics: metrics.New(reg, "test")}, nil)
			waitPosition(t, store, 0, 30)
			from := max(tt.stored, 0)
			if got, want := offsetsStored(t, db.Pool, 0), epochSpan(0, from, 29); fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("stored offsets %v, want %v", got, want)
			}
			if got := counter(t, reg, metrics.IngestReread); got != tt.reread {
				t.Errorf("%s = %v, want %v", metrics.IngestReread, got, tt.reread)
			}
			waitFor(t, 10*time.Second, "offsets committed up to the stored position", func() (bool, string) {
				c := k.committed(t, group)[0]
				return c == 30, fmt.Sprintf("committed %d", c)
			})
		})
	}
}

// Each batch is stored only if the partition's position is still where this
// process left it. Moved back by another writer mid-run (what a restore or a
// failover to a lagging replica does to a running process), the claim stops
// and starts again from the stored position: nothing is skipped.
func TestIngestNoticesRollbackWhileRunning(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t)
	store := NewStore(db.Pool, nil)
	ctx := t.Context()
	reg := prometheus.NewRegistry()
	r := startIngester(ctx, t, k, db.Pool, "rollback-running", IngestConfig{BatchSize: 100, BatchLinger: 10 * time.Millisecond,
		Metrics: metrics.New(reg, "test")}, nil)
	produce := func(n int) {
		var recs []*sarama.ProducerMessage
		for i := range n {
			recs = append(recs, validRec(1, fmt.Sprint("k-", i), "v"))
		}
		k.produce(t, recs...)
	}
	produce(10)
	waitPosition(t, store, 1, 10)

	// The database goes back to when it held offsets 0..3 of partition 1.
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "DELETE FROM deferred_message WHERE source_partition = 1 AND source_offset >= 4"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "UPDATE ingest_offset SET next_offset = 4 WHERE partition = 1"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	produce(5) // offsets 10..14: their batch finds the position moved
	waitPosition(t, store, 1, 15)
	if got, want := offsetsStored(t, db.Pool, 1), epochSpan(0, 0, 14); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("stored offsets %v, want %v: every record once, none skipped", got, want)
	}
	logs := r.logs()
	if !strings.Contains(logs, "ingest position rolled back") || !strings.Contains(logs, "expected_position=10") ||
		!strings.Contains(logs, "stored_position=4") {
		t.Errorf("no log line saying the position rolled back from 10 to 4:\n%s", logs)
	}
	if got := counter(t, reg, metrics.IngestRollbacks); got != 1 {
		t.Errorf("%s = %v, want 1", metrics.IngestRollbacks, got)
	}
	if got := counter(t, reg, metrics.IngestReread); got != 6 {
		t.Errorf("%s = %v, want 6 (offsets 4..9)", metrics.IngestReread, got)
	}
}

// The position check reads the stored positions and then compares them
// with the claims'. A batch that commits in between moves its claim's
// position past what the check read: that is not the database going back
// in time, and must neither be logged as such nor end the session. The
// check is held after its read (the afterPositions hook) while a record is
// produced and stored.
func TestIngestPositionCheckIsNotFooledByAWriteDuringIt(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t)
	store := NewStore(db.Pool, nil)
	reg := prometheus.NewRegistry()
	held, release := make(chan struct{}), make(chan struct{})
	var armed, done atomic.Bool
	r := startIngesterWith(t.Context(), t, k, db.Pool, "position-check-race", IngestConfig{BatchSize: 100,
		BatchLinger: 10 * time.Millisecond, PositionCheck: 50 * time.Millisecond, Metrics: metrics.New(reg, "test")},
		func(in *Ingester) {
			in.afterPositions = func() {
				if armed.Load() && done.CompareAndSwap(false, true) {
					close(held)
					<-release
				}
			}
		})
	k.produce(t, validRec(1, "k-0", "v"))
	waitPosition(t, store, 1, 1)
	armed.Store(true)
	select {
	case <-held:
	case <-time.After(30 * time.Second):
		t.Fatal("the position check did not run within 30s")
	}
	// The check has read position 1; offset 1 is stored meanwhile.
	k.produce(t, validRec(1, "k-1", "v"))
	waitPosition(t, store, 1, 2)
	waitFor(t, 30*time.Second, "the claim's own position at 2", func() (bool, string) {
		r.in.posMu.Lock()
		defer r.in.posMu.Unlock()
		return r.in.positions[1].Next == 2, fmt.Sprint(r.in.positions[1].Next)
	})
	close(release)
	// Three more checks, and a record through the same claim.
	time.Sleep(200 * time.Millisecond)
	k.produce(t, validRec(1, "k-2", "v"))
	waitPosition(t, store, 1, 3)
	if logs := r.logs(); strings.Contains(logs, "rolled back") || strings.Contains(logs, "looking at the partition again") {
		t.Errorf("a batch stored during the position check was taken for the database going back in time:\n%s", logs)
	}
	if got := counter(t, reg, metrics.IngestReread); got != 0 {
		t.Errorf("%s = %v, want 0", metrics.IngestReread, got)
	}
}

// A partition that gets no more records notices the rollback too: the
// session reads its stored positions every PositionCheck, and the records
// the database lost are read again without waiting for a new one.
func TestIngestNoticesRollbackOfAQuietPartition(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t)
	store := NewStore(db.Pool, nil)
	ctx := t.Context()
	r := startIngester(ctx, t, k, db.Pool, "rollback-quiet", IngestConfig{BatchSize: 100, BatchLinger: 10 * time.Millisecond,
		PositionCheck: 100 * time.Millisecond}, nil)
	var recs []*sarama.ProducerMessage
	for i := range 10 {
		recs = append(recs, validRec(2, fmt.Sprint("k-", i), "v"))
	}
	k.produce(t, recs...)
	waitPosition(t, store, 2, 10)
	if _, err := db.Pool.Exec(ctx, `BEGIN;
		DELETE FROM deferred_message WHERE source_partition = 2 AND source_offset >= 6;
		UPDATE ingest_offset SET next_offset = 6 WHERE partition = 2;
		COMMIT`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "offsets 6..9 stored again", func() (bool, string) {
		got := offsetsStored(t, db.Pool, 2)
		return fmt.Sprint(got) == fmt.Sprint(epochSpan(0, 0, 9)), fmt.Sprint(got)
	})
	if logs := r.logs(); !strings.Contains(logs, "ingest position rolled back") || !strings.Contains(logs, "stored_position=6") {
		t.Errorf("no log line saying the quiet partition's position rolled back to 6:\n%s", logs)
	}
}

// A stored position below the partition's log start means retention deleted
// records the database lost: they are reported, exactly, and counted, and
// ingest goes on from the log start, once.
func TestIngestReportsRecordsBelowLogStart(t *testing.T) {
	db := pgtest.NewDB(t)
	k := newKafka(t)
	store := NewStore(db.Pool, nil)
	var recs []*sarama.ProducerMessage
	for i := range 20 {
		recs = append(recs, validRec(2, fmt.Sprint("k-", i), "v"))
	}
	k.produce(t, recs...)
	none := Position{Topic: ingestTopic, Partition: 2, Next: NoPosition}
	if err := store.SetPosition(t.Context(), none, Position{Topic: ingestTopic, Partition: 2, Next: 5}, ""); err != nil {
		t.Fatal(err)
	}
	if err := k.admin.DeleteRecords(ingestTopic, map[int32]int64{2: 12}); err != nil {
		t.Fatalf("delete records: %v", err)
	}
	reg := prometheus.NewRegistry()
	r := startIngester(t.Context(), t, k, db.Pool, "below-log-start", IngestConfig{BatchSize: 100, BatchLinger: 10 * time.Millisecond,
		Metrics: metrics.New(reg, "test")}, nil)
	waitPosition(t, store, 2, 20)
	if got, want := offsetsStored(t, db.Pool, 2), epochSpan(0, 12, 19); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("stored offsets %v, want %v", got, want)
	}
	if got := counter(t, reg, metrics.IngestUnrecoverable); got != 7 {
		t.Errorf("%s = %v, want 7 (offsets 5..11)", metrics.IngestUnrecoverable, got)
	}
	if logs := r.logs(); !strings.Contains(logs, "records lost: the stored ingest position is below the partition's log start") ||
		!strings.Contains(logs, "from=5 to=12 records=7") {
		t.Errorf("no log line giving the lost range 5..11:\n%s", logs)
	}
	// Reported once: a restart finds the position at the log start's records.
	r.stop(t)
	r2 := startIngester(t.Context(), t, k, db.Pool, "below-log-start", IngestConfig{BatchSize: 100, BatchLinger: 10 * time.Millisecond}, nil)
	r2.waitJoined(t)
	if strings.Contains(r2.logs(), "records lost") {
		t.Errorf("the loss is reported again after a restart:\n%s", r2.logs())
	}
}

// The defer topic deleted and created again reuses offsets: ingest finds the
// partition re-created (its high-water mark below the stored position, or a
// new topic id), starts it from its start under a new epoch, and stores the
// new records although rows of the old topic sit at the same offsets.
func TestIngestPartitionRecreated(t *testing.T) {
	tests := []struct {
		name    string
		after   int  // records produced to the re-created topic
		running bool // the ingester runs through the re-creation
	}{
		{"high-water mark below the stored position", 5, false},
		{"high-water mark past it: only the topic id tells", 25, false},
		{"under a running ingester", 25, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			db := pgtest.NewDB(t)
			k := newKafka(t)
			store := NewStore(db.Pool, nil)
			produce := func(n int, prefix string) {
				var recs []*sarama.ProducerMessage
				for i := range n {
					recs = append(recs, validRec(0, fmt.Sprint(prefix, i), prefix))
				}
				k.produce(t, recs...)
			}
			produce(20, "old-")
			const group = "recreated"
			r := startIngester(t.Context(), t, k, db.Pool, group, IngestConfig{BatchSize: 100, BatchLinger: 10 * time.Millisecond,
				TopicCheck: 200 * time.Millisecond}, nil)
			if sp := waitPosition(t, store, 0, 20); sp.TopicID == "" {
				t.Fatalf("no topic id stored with the position: %+v", sp)
			}
			if !tt.running {
				r.stop(t)
			}

			if err := k.admin.DeleteTopic(ingestTopic); err != nil {
				t.Fatal(err)
			}
			waitFor(t, 10*time.Second, "the topic deleted", func() (bool, string) {
				topics, err := k.admin.ListTopics()
				_, ok := topics[ingestTopic]
				return err == nil && !ok, fmt.Sprint(err)
			})
			if err := k.admin.CreateTopic(ingestTopic, &sarama.TopicDetail{NumPartitions: ingestPartitions, ReplicationFactor: 1}, false); err != nil {
				t.Fatal(err)
			}
			produce(tt.after, "new-")

			reg := prometheus.NewRegistry()
			r2 := r
			if tt.running {
				r2 = nil
			}
			if !tt.running {
				r2 = startIngester(t.Context(), t, k, db.Pool, group, IngestConfig{BatchSize: 100, BatchLinger: 10 * time.Millisecond,
					Metrics: metrics.New(reg, "test")}, nil)
			}
			var sp StoredPosition
			waitFor(t, 30*time.Second, "the new topic's records stored under epoch 1", func() (bool, string) {
				got, err := store.Positions(t.Context(), ingestTopic, []int32{0})
				if err != nil {
					t.Fatal(err)
				}
				sp = got[0]
				return sp.Epoch == 1 && sp.Next == int64(tt.after), fmt.Sprintf("position %+v", sp)
			})
			want := append(epochSpan(0, 0, 19), epochSpan(1, 0, int64(tt.after-1))...)
			got := offsetsStored(t, db.Pool, 0)
			if tt.running {
				// Read before the new id was noticed, records of the new
				// topic past the old position are stored under epoch 0
				// too: duplicates, never a gap.
				var dups []string
				for _, g := range got {
					var e int32
					var o int64
					if _, err := fmt.Sscanf(g, "%d:%d", &e, &o); err == nil && e == 0 && o >= 20 {
						dups = append(dups, g)
					}
				}
				got = slicesWithout(got, dups)
				t.Logf("%d records of the new topic stored under the old epoch too, before the new id was noticed", len(dups))
			}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("stored (epoch:offset) %v, want %v", got, want)
			}
			if got := counter(t, reg, metrics.IngestPartitionResets); !tt.running && got < 1 {
				t.Errorf("%s = %v, want at least 1", metrics.IngestPartitionResets, got)
			}
			logs := r.logs()
			if r2 != nil {
				logs = r2.logs()
			}
			if !strings.Contains(logs, "partition was re-created or truncated") {
				t.Errorf("no log line saying the partition was re-created:\n%s", logs)
			}
		})
	}
}

// The marks ingest commits with its offsets read back as they were written;
// anything else is not taken for marks.
func TestMarksMetadata(t *testing.T) {
	tests := []struct {
		meta    string
		id, seq int64
		ok      bool
	}{
		{"hw:12,34", 12, 34, true},
		{"hw:0,0", 0, 0, true},
		{"", 0, 0, false},
		{"hw:12", 0, 0, false},
		{"hw:x,1", 0, 0, false},
		{"someone else's", 0, 0, false},
	}
	for _, tt := range tests {
		id, seq, ok := parseMarks(tt.meta)
		if id != tt.id || seq != tt.seq || ok != tt.ok {
			t.Errorf("parseMarks(%q) = %d, %d, %v; want %d, %d, %v", tt.meta, id, seq, ok, tt.id, tt.seq, tt.ok)
		}
	}
	in := &Ingester{store: NewStore(nil, &highwater.Marks{})}
	in.store.marks.Observe(99, 1234)
	if id, seq, ok := parseMarks(in.marksMetadata()); !ok || id != 99 || seq != 1234 {
		t.Errorf("marksMetadata() = %q reads back as %d, %d, %v", in.marksMetadata(), id, seq, ok)
	}
}
