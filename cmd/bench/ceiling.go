package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/internal/batchproducer"

	"github.com/deferq/scheduler/internal/defer/ingest"
	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/dispatch"
	"github.com/deferq/scheduler/internal/keylock"
)

// The service's defaults, which the in-process contenders copy so that they
// do the same work per round trip as the service.
const (
	ingestBatch   = 1000 // INGEST_BATCH_SIZE
	dispatchLoops = 4    // DISPATCH_WORKERS
	claimKeys     = 500  // DISPATCH_BATCH_KEYS
	perKey        = 100  // DISPATCH_KEY_BATCH
)

// ceilingResult is what Postgres alone allows with the service's SQL.
type ceilingResult struct {
	pipeline rate // insert and claim+delete at once: the ceiling
	insert   rate // insert alone
	drain    rate // claim+delete alone, of rows already due
}

// runCeiling measures the database ceiling: the rows the end-to-end phase
// stores (own keys, due now), inserted with ingest.Store.Insert in
// ingest's batches by one writer per partition, and claimed and finalized as
// published with keylock.Locker by the service's number of loops, without
// any Kafka. First both at once on a fresh database (the ceiling proper),
// then insert alone, then drain alone.
func (b *bench) runCeiling(ctx context.Context) (res ceilingResult, err error) {
	db, err := b.pg.fresh(ctx, "ceiling")
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, b.pg.drop(context.WithoutCancel(ctx), db)) }()
	store := ingest.NewStore(db.pool, nil)
	lockers := make([]*keylock.Locker, dispatchLoops)
	for i := range lockers {
		if lockers[i], err = keylock.New(db.pool, keylock.Config{
			Owner: fmt.Sprintf("bench-ceiling-%d", i), Lease: 90 * time.Second, PerKey: perKey,
		}); err != nil {
			return res, err
		}
	}
	rules := protocol.Rules{Targets: protocol.TargetPatterns{"bench.*"}, MaxDelay: 720 * time.Hour}

	// Warm-up: connections, plans, caches.
	if _, err := b.ceilingRun(ctx, db, store, lockers, rules, "w", b.cfg.Warmup, true, true); err != nil {
		return res, err
	}
	if res.pipeline, err = b.ceilingRun(ctx, db, store, lockers, rules, "p", b.cfg.N, true, true); err != nil {
		return res, err
	}
	if res.insert, err = b.ceilingRun(ctx, db, store, lockers, rules, "i", b.cfg.N, true, false); err != nil {
		return res, err
	}
	if res.drain, err = b.ceilingRun(ctx, db, store, lockers, rules, "i", b.cfg.N, false, true); err != nil {
		return res, err
	}
	return res, nil
}

// ceilingRun inserts (when insert) n rows of phase, and drains (when drain)
// n due rows, concurrently, and returns the rate. The entries are parsed
// before the clock starts: this is the database's ceiling, not the parser's.
func (b *bench) ceilingRun(ctx context.Context, db *database, store *ingest.Store, lockers []*keylock.Locker,
	rules protocol.Rules, phase string, n int, insert, drain bool) (rate, error) {
	parts := int(b.cfg.Partitions)
	byPart := make([][]ingest.Entry, parts)
	if insert {
		now := time.Now()
		// The source offsets continue where the previous run of the phase
		// stopped, as ingest's would.
		var base int64
		if err := db.pool.QueryRow(ctx, "SELECT coalesce(max(next_offset), 0) FROM ingest_offset WHERE topic = $1",
			"ceiling."+phase).Scan(&base); err != nil {
			return rate{}, fmt.Errorf("ceiling: read offsets: %w", err)
		}
		for i := range n {
			key := ownKeys.key(phase+"c", i)
			msg := deferRecord(key, i, topicE2E, when{})
			rec := protocol.Record{Key: []byte(key), Value: payload(i)}
			for _, h := range msg.Headers {
				rec.Headers = append(rec.Headers, protocol.Header{Key: h.Key, Value: h.Value})
			}
			sc, err := protocol.Parse(rec, rules, now)
			if err != nil {
				return rate{}, fmt.Errorf("ceiling: parse record %d: %w", i, err)
			}
			p := i % parts
			byPart[p] = append(byPart[p], ingest.Entry{Offset: base + int64(len(byPart[p])), Record: rec, Schedule: sc})
		}
	}

	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		errs    []error
		drained atomic.Int64
	)
	fail := func(err error) {
		mu.Lock()
		errs = append(errs, err)
		mu.Unlock()
	}
	cctx, cancel := context.WithTimeout(ctx, timeoutFor(n))
	defer cancel()
	cpu0 := b.cpu(0)
	start := time.Now()
	if insert {
		for p := range parts {
			wg.Go(func() {
				entries := byPart[p]
				// Each writer is the only one of its partition: it knows
				// the stored position without reading it.
				pos := ingest.Position{Topic: "ceiling." + phase, Partition: int32(p), Next: ingest.NoPosition}
				for len(entries) > 0 {
					batch := entries[:min(ingestBatch, len(entries))]
					entries = entries[len(batch):]
					if _, err := store.Insert(cctx, pos, batch); err != nil {
						fail(err)
						cancel()
						return
					}
					pos.Next = batch[len(batch)-1].Offset + 1
				}
			})
		}
	}
	if drain {
		for _, l := range lockers {
			wg.Go(func() {
				for drained.Load() < int64(n) && cctx.Err() == nil {
					claims, err := l.Claim(cctx, claimKeys)
					if err != nil {
						fail(err)
						cancel()
						return
					}
					if len(claims) == 0 {
						// Nothing due yet: the service would sleep until
						// notified; a short poll is the ceiling's stand-in.
						time.Sleep(2 * time.Millisecond)
						continue
					}
					var out keylock.Outcome
					for _, c := range claims {
						for _, m := range c.Messages {
							out.Published = append(out.Published, m.ID)
						}
					}
					if err := l.Finalize(cctx, claims, out); err != nil {
						fail(err)
						cancel()
						return
					}
					drained.Add(int64(len(out.Published)))
				}
			})
		}
	}
	// The service checks the queue tables' statistics every two seconds
	// (keylock.AnalyzeIfStale); so does the ceiling, so that an autovacuum
	// analyze in mid-run cannot leave it on plans the service would have
	// corrected.
	stats := make(chan struct{})
	go func() {
		defer close(stats)
		t := time.NewTicker(2 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-cctx.Done():
				return
			case <-t.C:
			}
			if _, err := keylock.AnalyzeIfStale(cctx, db.pool, 1000); err != nil && cctx.Err() == nil {
				fail(err)
				cancel()
				return
			}
		}
	}()
	wg.Wait()
	wall := time.Since(start)
	cancel()
	<-stats
	if len(errs) > 0 {
		return rate{}, fmt.Errorf("ceiling: %w", errors.Join(errs...))
	}
	if drain && drained.Load() != int64(n) {
		return rate{}, fmt.Errorf("ceiling: drained %d of %d rows: %w", drained.Load(), n, cctx.Err())
	}
	return rate{n: int64(n), wall: wall, cpu: b.cpu(0).sub(cpu0)}, nil
}

// brokerResult is what the broker takes from sarama.
type brokerResult struct {
	sync  rate // the service's producer settings and call pattern
	async rate // sarama's AsyncProducer with its defaults
}

// runBroker measures the broker's ceiling with the records the service
// publishes (the end-to-end phase's messages, as dispatch.Record builds
// them): first as the service publishes (batchproducer with
// batchproducer.Config: acks=all, whole record batches per partition; one
// producer shared by the service's number of loops, each sending a claim's
// worth per SendMessages), then with
// an AsyncProducer on sarama's defaults plus acks=all, as fast as it goes.
func (b *bench) runBroker(ctx context.Context) (res brokerResult, err error) {
	kc, addr, err := startKafka(b.cfg.Partitions, topicBroker)
	if err != nil {
		return res, err
	}
	defer kc.Close()
	n := b.cfg.N
	msgs := func(phase string) []*sarama.ProducerMessage {
		out := make([]*sarama.ProducerMessage, n)
		now := time.Now()
		for i := range out {
			key := ownKeys.key(phase, i)
			m := keylock.Message{ID: int64(i + 1), Seq: int64(i + 1), Target: topicBroker, NextRunAt: now,
				Key: []byte(key), Value: payload(i)}
			for _, h := range deferRecord(key, i, topicBroker, when{}).Headers {
				m.Headers = append(m.Headers, keylock.Header{Key: string(h.Key), Value: h.Value})
			}
			out[i] = dispatch.Record(m)
		}
		return out
	}

	sp, err := batchproducer.New([]string{addr}, batchproducer.Config(kafkaConfig()))
	if err != nil {
		return res, fmt.Errorf("broker ceiling: %w", err)
	}
	defer sp.Close()
	syncSend := func(all []*sarama.ProducerMessage) error {
		var wg sync.WaitGroup
		errs := make([]error, dispatchLoops)
		for loop := range dispatchLoops {
			wg.Go(func() {
				for i := loop * claimKeys; i < len(all); i += dispatchLoops * claimKeys {
					if err := sp.SendMessages(all[i:min(i+claimKeys, len(all))]); err != nil {
						errs[loop] = err
						return
					}
				}
			})
		}
		wg.Wait()
		return errors.Join(errs...)
	}
	warm := msgs("bw")
	if err := syncSend(warm[:min(b.cfg.Warmup, len(warm))]); err != nil {
		return res, fmt.Errorf("broker ceiling warm-up: %w", err)
	}
	all := msgs("bs")
	cpu0 := b.cpu(0)
	start := time.Now()
	if err := syncSend(all); err != nil {
		return res, fmt.Errorf("broker ceiling: %w", err)
	}
	res.sync = rate{n: int64(n), wall: time.Since(start), cpu: b.cpu(0).sub(cpu0)}

	ac := kafkaConfig()
	ac.Producer.RequiredAcks = sarama.WaitForAll
	ac.Producer.Return.Successes = true
	ac.Producer.Partitioner = sarama.NewMurmur2Partitioner
	ap, err := sarama.NewAsyncProducer([]string{addr}, ac)
	if err != nil {
		return res, fmt.Errorf("broker ceiling: %w", err)
	}
	defer ap.Close()
	all = msgs("ba")
	done := make(chan error, 1)
	go func() {
		for range n {
			select {
			case <-ap.Successes():
			case pe := <-ap.Errors():
				done <- pe.Err
				return
			case <-ctx.Done():
				done <- ctx.Err()
				return
			}
		}
		done <- nil
	}()
	cpu0 = b.cpu(0)
	start = time.Now()
	for _, m := range all {
		select {
		case ap.Input() <- m:
		case <-ctx.Done():
			return res, ctx.Err()
		}
	}
	if err := <-done; err != nil {
		return res, fmt.Errorf("broker ceiling (async): %w", err)
	}
	res.async = rate{n: int64(n), wall: time.Since(start), cpu: b.cpu(0).sub(cpu0)}
	return res, nil
}
