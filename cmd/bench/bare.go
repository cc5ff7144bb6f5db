package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/IBM/sarama"
	"github.com/jackc/pgx/v5"

	"github.com/deferq/scheduler/internal/batchproducer"
	"github.com/deferq/scheduler/internal/defer/ingest"
	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/dispatch"
	"github.com/deferq/scheduler/internal/keylock"
)

// BENCH_ONLY's values of this file: the bare durable queue beside the
// service's own-key scenario, and the own-key scenario on 4 and on 64
// partitions.
const (
	onlyBare       = "bare"
	onlyPartitions = "partitions"
	// onlyLateness is the own-key scenario with its lateness phases, the
	// second after a VACUUM of the emptied queue tables.
	onlyLateness = "lateness"
)

// widePartitions is the partition count of the own-key scenario's second run
// (scheduler.defer and every target topic): how the service does when
// ingest has many claims, each with a small share of the records.
const widePartitions = 64

// The bare durable queue's timings: a partition's batch is written after
// INGEST_BATCH_LINGER at the latest, as the service's; a dispatch loop that
// nothing woke looks again after POLL_INTERVAL, as the service's. Batch
// size, loops and claim size are the service's too (ingestBatch,
// dispatchLoops, claimKeys).
const (
	bareLinger = 20 * time.Millisecond
	barePoll   = time.Second
)

// bareSchema is the bare durable queue's whole schema: one row per message,
// with what the service stores of it to publish it (due time, target, key,
// value, every header), the one index a due-time claim needs, and each
// partition's next offset to read. No key heads, no history, no states: a
// row exists until its message is published.
const bareSchema = bareMessageTable + `
CREATE INDEX bare_message_due ON bare_message (due_at);
` + bareOffsetSchema

// bareMessageTable is both bare queues' message table, as the bare queue
// has it.
const bareMessageTable = `
CREATE TABLE bare_message (
    id            bigserial PRIMARY KEY,
    due_at        timestamptz NOT NULL,
    target_topic  text NOT NULL,
    key           bytea,
    value         bytea,
    header_keys   text[] NOT NULL,
    header_values bytea[] NOT NULL
);`

// bareOffsetSchema is each partition's next offset to read, in both bare
// queues.
const bareOffsetSchema = `
CREATE TABLE bare_offset (
    partition   int PRIMARY KEY,
    next_offset bigint NOT NULL
)`

// orderedSchema is the ordered bare queue's schema: the bare queue plus
// what per-key order needs at least, kept on the message row (no second
// table). is_head marks a key's first message, the only one of the key a
// claim may take; a message without a key is its own head. The due-time
// index holds heads only, the unique index on the key allows one head per
// key (and finds it at insert), and the key's next message is found in an
// index that holds only the messages behind a head: a key with one message
// writes no entry there.
const orderedSchema = bareMessageTable + `
ALTER TABLE bare_message ADD COLUMN business_key text COLLATE "C", ADD COLUMN is_head boolean NOT NULL;
CREATE INDEX bare_message_due ON bare_message (due_at) WHERE is_head;
CREATE UNIQUE INDEX bare_message_head ON bare_message (business_key) WHERE is_head;
CREATE INDEX bare_message_next ON bare_message (business_key, id) WHERE NOT is_head;
` + bareOffsetSchema

// bareInsert stores one batch of one partition, and moves the partition's
// next offset to $2 in the same statement, as ingest_insert.sql does: the
// rows and the position commit together, so a restart reads on from the
// position and stores every record once. $1 is the partition; $3 to $7 have
// one element per record (due time or NULL, delay in microseconds, target,
// key, value); the headers come flattened as in ingest_insert.sql, $8 the
// 1-based record of each, $9 and $10 its key and value. Like the service,
// a delay counts from the database's clock, which the claim reads too.
const bareInsert = bareInsertBatch + `
INSERT INTO bare_message (due_at, target_topic, key, value, header_keys, header_values)
SELECT coalesce(r.run_at, now() + r.delay_us * interval '1 microsecond'), r.target_topic, r.key, r.value,
       coalesce(h.keys, '{}'), coalesce(h.vals, '{}')
FROM unnest($3::timestamptz[], $4::bigint[], $5::text[], $6::bytea[], $7::bytea[])
     WITH ORDINALITY AS r (run_at, delay_us, target_topic, key, value, record)
LEFT JOIN headers h ON h.record = r.record`

// bareInsertBatch opens both bare queues' insert statements: the
// partition's next offset, and the batch's headers gathered per record.
const bareInsertBatch = `
WITH position AS (
    INSERT INTO bare_offset (partition, next_offset) VALUES ($1, $2)
    ON CONFLICT (partition) DO UPDATE SET next_offset = excluded.next_offset
), headers AS (
    SELECT h.record, array_agg(h.key ORDER BY h.position) AS keys, array_agg(h.value ORDER BY h.position) AS vals
    FROM unnest($8::int[], $9::text[], $10::bytea[]) WITH ORDINALITY AS h (record, key, value, position)
    GROUP BY h.record
)`

// orderedInsert is bareInsert for the ordered bare queue; $11 has each
// record's business key or NULL. A record is its key's head when it is the
// key's first in the batch and the key has no head stored: the head is
// read FOR KEY SHARE, so that a claim deleting it meanwhile (it holds it
// FOR UPDATE) is waited for, or skips it until this commits and then
// promotes this batch's record. (A claim that promoted another message
// while this waited makes this statement fail on the unique head index; the
// bench's records, one key each, never meet that.)
const orderedInsert = bareInsertBatch + `, recs AS (
    SELECT r.*, r.business_key IS NULL OR r.record = min(r.record) OVER (PARTITION BY r.business_key) AS first
    FROM unnest($3::timestamptz[], $4::bigint[], $5::text[], $6::bytea[], $7::bytea[], $11::text[])
         WITH ORDINALITY AS r (run_at, delay_us, target_topic, key, value, business_key, record)
)
INSERT INTO bare_message (business_key, is_head, due_at, target_topic, key, value, header_keys, header_values)
SELECT r.business_key,
       r.first AND NOT EXISTS (SELECT FROM bare_message o WHERE o.business_key = r.business_key AND o.is_head FOR KEY SHARE),
       coalesce(r.run_at, now() + r.delay_us * interval '1 microsecond'), r.target_topic, r.key, r.value,
       coalesce(h.keys, '{}'), coalesce(h.vals, '{}')
FROM recs r
LEFT JOIN headers h ON h.record = r.record
ORDER BY r.record`

// bareClaim deletes up to $1 due rows, oldest due first, skipping rows
// another loop holds, and returns them. It runs in a transaction that
// commits only after the rows' messages are published (publishDue): the
// cheapest shape that loses nothing. Each row is written once (its delete),
// and a process that dies before the commit, or a publish that fails, rolls
// the delete back, so the rows are due again and published again (at least
// once, as the service). A lease (UPDATE, publish, DELETE) would write every
// row twice to keep no transaction open over the publish; with four loops,
// four open transactions of a few milliseconds each cost nothing.
const bareClaim = `
WITH due AS (
    SELECT id FROM bare_message WHERE due_at <= now() ORDER BY due_at LIMIT $1 FOR UPDATE SKIP LOCKED
)
DELETE FROM bare_message m USING due WHERE m.id = due.id
RETURNING m.id, m.due_at, m.target_topic, m.key, m.value, m.header_keys, m.header_values`

// orderedClaim is bareClaim for the ordered bare queue: it takes due heads
// only, and makes each deleted head's next message its key's head, in the
// same statement (visible when the claim commits, after the publish). The
// next messages are found by key and updated by id, so that no plan made
// on an empty table's statistics scans the table for them.
const orderedClaim = `
WITH due AS (
    SELECT id FROM bare_message WHERE is_head AND due_at <= now() ORDER BY due_at LIMIT $1 FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM bare_message m USING due WHERE m.id = due.id
    RETURNING m.id, m.business_key, m.due_at, m.target_topic, m.key, m.value, m.header_keys, m.header_values
), promoted AS (
    UPDATE bare_message n SET is_head = true
    WHERE n.id = ANY (ARRAY(
        SELECT (SELECT o.id FROM bare_message o WHERE o.business_key = g.business_key AND NOT o.is_head ORDER BY o.id LIMIT 1)
        FROM gone g WHERE g.business_key IS NOT NULL))
)
SELECT id, due_at, target_topic, key, value, header_keys, header_values FROM gone`

// bareResult is the bare durable queue's measurements.
type bareResult struct {
	e2e   rate
	check check // of the end-to-end phase's target
}

// bareQueue is the bare durable queue: one table, written once per message
// and deleted once, in this process.
type bareQueue struct {
	db       *database
	producer *batchproducer.Producer
	rules    protocol.Rules
	// ordered: the ordered bare queue (orderedSchema), not the bare one.
	ordered bool
	// wake has one channel per dispatch loop, each holding at most one
	// signal: ingest signals every loop after each commit, so a loop that
	// found fewer rows than it asked for waits for new rows without
	// polling, and misses none (a signal sent while it works waits for it).
	wake []chan struct{}
}

// runBare measures what durability alone costs: a bare durable queue built
// with the service's Kafka clients and batch sizes but none of its
// machinery (no key heads, no history, no per-key order, no lease rows).
// Ingest reads each partition of scheduler.defer with a partition consumer
// from the position stored with the rows, parses each record
// (protocol.Parse, as the service) and writes each partition's batches of
// up to ingestBatch records / bareLinger with bareInsert;
// dispatchLoops loops claim, publish (batchproducer, dispatch.Record) and
// delete with bareClaim. After a warm-up, it runs the service's end-to-end
// phase (the same records, own keys, due now), timed from the first produce
// to the last arrival, on a fresh database and broker, in this process.
//
// With ordered, it is the ordered bare queue instead: the same with per-key
// order kept on the message row (orderedSchema, orderedInsert,
// orderedClaim), what key order costs at the least in this shape.
func (b *bench) runBare(ctx context.Context, ordered bool) (res bareResult, err error) {
	what, schema, profile := "bare queue", bareSchema, "bare"
	if ordered {
		what, schema, profile = "ordered bare queue", orderedSchema, "ordered"
	}
	db, err := b.pg.fresh(ctx, "bare")
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, b.pg.drop(context.WithoutCancel(ctx), db)) }()
	if _, err := db.pool.Exec(ctx, schema); err != nil {
		return res, fmt.Errorf("%s: create its tables: %w", what, err)
	}
	kc, addr, err := startKafka(b.cfg.Partitions, deferTopic, topicWarmup, topicE2E)
	if err != nil {
		return res, err
	}
	defer kc.Close()
	sp, err := batchproducer.New([]string{addr}, batchproducer.Config(kafkaConfig()))
	if err != nil {
		return res, fmt.Errorf("bare queue: producer: %w", err)
	}
	defer sp.Close()
	// The service's consumer settings (fetch sizes, buffers); a partition
	// consumer needs no group: the positions are in the database.
	consumer, err := sarama.NewConsumer([]string{addr}, ingest.ConsumerConfig(kafkaConfig(), nil))
	if err != nil {
		return res, fmt.Errorf("bare queue: consumer: %w", err)
	}
	defer consumer.Close()
	parts, err := consumer.Partitions(deferTopic)
	if err != nil {
		return res, fmt.Errorf("bare queue: partitions of %s: %w", deferTopic, err)
	}
	stored := map[int32]int64{}
	rows, err := db.pool.Query(ctx, "SELECT partition, next_offset FROM bare_offset")
	if err != nil {
		return res, fmt.Errorf("bare queue: read positions: %w", err)
	}
	for rows.Next() {
		var p int32
		var next int64
		if err := rows.Scan(&p, &next); err != nil {
			rows.Close()
			return res, fmt.Errorf("bare queue: read positions: %w", err)
		}
		stored[p] = next
	}
	if err := rows.Err(); err != nil {
		return res, fmt.Errorf("bare queue: read positions: %w", err)
	}

	q := &bareQueue{db: db, producer: sp, ordered: ordered, wake: make([]chan struct{}, dispatchLoops),
		rules: protocol.Rules{Targets: protocol.TargetPatterns{"bench.*"}, MaxDelay: 720 * time.Hour}}
	for i := range q.wake {
		q.wake[i] = make(chan struct{}, 1)
	}
	// qctx ends every statement and publish on a failure; quit stops the
	// queue between batches at the end, so that no transaction is cut short
	// and the rows left can be counted.
	qctx, cancel := context.WithCancel(ctx)
	defer cancel()
	quit := make(chan struct{})
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	fail := func(err error) {
		mu.Lock()
		errs = append(errs, err)
		mu.Unlock()
		cancel()
	}
	// stop stops the queue and returns why it failed, if it did; the
	// first call only.
	var once sync.Once
	stop := func() (err error) {
		once.Do(func() {
			close(quit)
			wg.Wait()
			mu.Lock()
			err = errors.Join(errs...)
			mu.Unlock()
		})
		return err
	}
	defer func() {
		cancel() // on an early return; after a clean stop, nothing runs
		err = errors.Join(err, stop())
	}()
	for _, p := range parts {
		from, ok := stored[p]
		if !ok {
			from = sarama.OffsetOldest
		}
		pc, err := consumer.ConsumePartition(deferTopic, p, from)
		if err != nil {
			return res, fmt.Errorf("bare queue: consume %s/%d: %w", deferTopic, p, err)
		}
		wg.Go(func() {
			defer pc.Close()
			// An error after the cancel is its consequence: the first
			// says why.
			if err := q.ingest(qctx, quit, pc, p); err != nil && qctx.Err() == nil {
				fail(err)
			}
		})
	}
	for _, wake := range q.wake {
		wg.Go(func() {
			if err := q.dispatch(qctx, quit, wake); err != nil && qctx.Err() == nil {
				fail(err)
			}
		})
	}

	lp, w, err := newClients(addr)
	if err != nil {
		return res, err
	}
	defer lp.close()
	defer w.close()

	// The service's records exactly: same keys, values and headers.
	n, warm := b.cfg.N, b.cfg.Warmup
	if res.e2e, err = b.endToEnd(qctx, lp, w, db, what, profile, "w", "e"); err != nil {
		return res, err
	}
	if err := stop(); err != nil {
		return res, err
	}

	// Checks: every message arrived (the bare queue promises no order, so
	// only presence counts; the ordered one keeps it), and no row is left:
	// every published row was deleted, every delete committed.
	for _, ph := range []phaseTopic{{topicWarmup, warm}, {topicE2E, n}} {
		ds, err := readBack(ctx, addr, ph.topic)
		if err != nil {
			return res, err
		}
		c := verify(ds, ph.n)
		if !ordered {
			c.outOfOrder = 0
		}
		if err := c.err(what + ", " + ph.topic); err != nil {
			return res, err
		}
		if ph.topic == topicE2E {
			res.check = c
		}
	}
	var left int64
	if err := db.pool.QueryRow(ctx, "SELECT count(*) FROM bare_message").Scan(&left); err != nil {
		return res, fmt.Errorf("%s: count rows left: %w", what, err)
	}
	if left > 0 {
		return res, fmt.Errorf("%s: %d rows left after every message arrived", what, left)
	}
	return res, nil
}

// ingest reads partition through pc and stores its records in batches of up
// to ingestBatch, or what came within bareLinger of a batch's first record,
// until quit. A batch not yet stored then is not lost: its offsets were not
// stored either, so a restart reads it again. (The service also bounds a
// batch's bytes, 4 MiB by default, which these records never reach.)
func (q *bareQueue) ingest(ctx context.Context, quit <-chan struct{}, pc sarama.PartitionConsumer, partition int32) error {
	batch := make([]*sarama.ConsumerMessage, 0, ingestBatch)
	linger := time.NewTimer(time.Hour)
	linger.Stop()
	defer linger.Stop()
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		if err := q.store(ctx, partition, batch); err != nil {
			return err
		}
		clear(batch) // no record kept alive by the backing array
		batch = batch[:0]
		return nil
	}
	for {
		select {
		case m := <-pc.Messages():
			if len(batch) == 0 {
				linger.Reset(bareLinger)
			}
			batch = append(batch, m)
			if len(batch) >= ingestBatch {
				linger.Stop()
				if err := flush(); err != nil {
					return err
				}
			}
		case <-linger.C:
			if err := flush(); err != nil {
				return err
			}
		case cerr := <-pc.Errors():
			return fmt.Errorf("bare queue: consume %s/%d: %w", deferTopic, partition, cerr)
		case <-quit:
			return nil
		case <-ctx.Done():
			return nil
		}
	}
}

// store parses msgs, all of partition, and stores them with the partition's
// next offset in one statement, then wakes the dispatch loops.
func (q *bareQueue) store(ctx context.Context, partition int32, msgs []*sarama.ConsumerMessage) error {
	now := time.Now()
	var (
		at      = make([]*time.Time, len(msgs)) // nil: due after delay
		delay   = make([]int64, len(msgs))
		targets = make([]string, len(msgs))
		bizKeys = make([]*string, len(msgs)) // nil: no business key
		keys    = make([][]byte, len(msgs))
		values  = make([][]byte, len(msgs))
		hRecord []int32
		hKey    []string
		hValue  [][]byte
	)
	for i, m := range msgs {
		rec := protocol.Record{Key: m.Key, Value: m.Value, Headers: make([]protocol.Header, len(m.Headers))}
		for j, h := range m.Headers {
			rec.Headers[j] = protocol.Header{Key: h.Key, Value: h.Value}
			hRecord = append(hRecord, int32(i+1))
			hKey = append(hKey, string(h.Key))
			hValue = append(hValue, h.Value)
		}
		sc, err := protocol.Parse(rec, q.rules, now)
		if err != nil {
			// The bench produces only valid records; the service would
			// store this one as rejected.
			return fmt.Errorf("bare queue: %s/%d offset %d: %w", deferTopic, partition, m.Offset, err)
		}
		if sc.HasAt {
			at[i] = &sc.At
		} else {
			delay[i] = sc.Delay.Microseconds()
		}
		targets[i], keys[i], values[i] = sc.Target, m.Key, m.Value
		if sc.Ordered {
			bizKeys[i] = &sc.BusinessKey
		}
	}
	next := msgs[len(msgs)-1].Offset + 1
	stmt, args := bareInsert, []any{partition, next, at, delay, targets, keys, values, hRecord, hKey, hValue}
	if q.ordered {
		stmt, args = orderedInsert, append(args, bizKeys)
	}
	if _, err := q.db.pool.Exec(ctx, stmt, args...); err != nil {
		return fmt.Errorf("bare queue: store %d records of %s/%d: %w", len(msgs), deferTopic, partition, err)
	}
	for _, w := range q.wake {
		select {
		case w <- struct{}{}:
		default: // a signal is already waiting
		}
	}
	return nil
}

// dispatch publishes due rows until quit: claimKeys at a time while claims
// come back full, else after the next signal of ingest (or barePoll).
func (q *bareQueue) dispatch(ctx context.Context, quit <-chan struct{}, wake <-chan struct{}) error {
	for {
		select {
		case <-quit:
			return nil
		default:
		}
		n, err := q.publishDue(ctx)
		if err != nil {
			return err
		}
		if n == claimKeys {
			continue
		}
		select {
		case <-wake:
		case <-time.After(barePoll):
		case <-quit:
			return nil
		case <-ctx.Done():
			return nil
		}
	}
}

// publishDue claims up to claimKeys due rows by deleting them (bareClaim),
// publishes their messages as the service builds them (dispatch.Record; the
// row's id as defer.id and defer.seq), and commits the delete only then. It
// returns how many it published.
func (q *bareQueue) publishDue(ctx context.Context) (n int, err error) {
	tx, err := q.db.pool.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("bare queue: begin a claim: %w", err)
	}
	committed := false
	defer func() {
		if !committed {
			// The rows are due again, as after a crash.
			err = errors.Join(err, tx.Rollback(context.WithoutCancel(ctx)))
		}
	}()
	claim := bareClaim
	if q.ordered {
		claim = orderedClaim
	}
	rows, err := tx.Query(ctx, claim, claimKeys)
	if err != nil {
		return 0, fmt.Errorf("bare queue: claim: %w", err)
	}
	msgs, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (*sarama.ProducerMessage, error) {
		var (
			m  keylock.Message
			hk []string
			hv [][]byte
		)
		if err := row.Scan(&m.ID, &m.NextRunAt, &m.Target, &m.Key, &m.Value, &hk, &hv); err != nil {
			return nil, err
		}
		m.Seq = m.ID
		m.Headers = make([]keylock.Header, len(hk))
		for i := range hk {
			m.Headers[i] = keylock.Header{Key: hk[i], Value: hv[i]}
		}
		return dispatch.Record(m), nil
	})
	if err != nil {
		return 0, fmt.Errorf("bare queue: claim: %w", err)
	}
	if len(msgs) == 0 {
		return 0, nil
	}
	if err := q.producer.SendMessages(msgs); err != nil {
		return 0, fmt.Errorf("bare queue: publish %d messages: %w", len(msgs), err)
	}
	committed = true
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("bare queue: delete %d published rows: %w", len(msgs), err)
	}
	return len(msgs), nil
}

// runWide runs the own-key scenario (no far-future rows, no lateness) on
// widePartitions partitions, into res.wide.
func (b *bench) runWide(ctx context.Context, res *results) error {
	b.say("scheduler: %s, %d partitions", ownKeys.label, widePartitions)
	sc, err := b.runSchedulerOn(ctx, ownKeys, 0, false, widePartitions)
	if err != nil {
		return fmt.Errorf("scheduler, %s, %d partitions: %w", ownKeys.label, widePartitions, err)
	}
	b.say("  ingest %.0f/s, dispatch %.0f/s, end to end %.0f/s", sc.ingest.perSecond(), sc.dispatch.perSecond(), sc.e2e.perSecond())
	res.wide = &sc
	return nil
}

// runBareContender runs the bare durable queue, into res.bare.
func (b *bench) runBareContender(ctx context.Context, res *results) error {
	b.say("bare durable queue: one table, written once and deleted once per message")
	bare, err := b.runBare(ctx, false)
	if err != nil {
		return err
	}
	b.say("  %.0f/s", bare.e2e.perSecond())
	res.bare = bare
	b.say("ordered bare queue: the same with per-key order on the message row")
	if res.ordered, err = b.runBare(ctx, true); err != nil {
		return err
	}
	b.say("  %.0f/s", res.ordered.e2e.perSecond())
	return nil
}

// runOnlyDurability is BENCH_ONLY=bare, BENCH_ONLY=partitions and
// BENCH_ONLY=lateness: the service's own-key scenario (with the lateness
// phases only for lateness), then the bare queue or the same scenario on
// widePartitions partitions.
func (b *bench) runOnlyDurability(ctx context.Context, res *results) error {
	b.say("scheduler: %s, %d partitions", ownKeys.label, b.cfg.Partitions)
	sc, err := b.runScheduler(ctx, ownKeys, 0, b.cfg.Only == onlyLateness)
	if err != nil {
		return fmt.Errorf("scheduler, %s: %w", ownKeys.label, err)
	}
	b.say("  ingest %.0f/s, dispatch %.0f/s, end to end %.0f/s", sc.ingest.perSecond(), sc.dispatch.perSecond(), sc.e2e.perSecond())
	res.scenarios = append(res.scenarios, sc)
	switch b.cfg.Only {
	case onlyPartitions:
		return b.runWide(ctx, res)
	case onlyLateness:
		return nil
	}
	return b.runBareContender(ctx, res)
}

// summarizeDurability adds the figures of the bare queue and of the
// scenario on widePartitions partitions, those that were measured, against
// the own-key scenario (r.scenarios[0]).
func (r *results) summarizeDurability(s *summary) {
	own := r.scenarios[0]
	if r.bare.e2e.n > 0 {
		perMsg := func(d time.Duration) float64 { return float64(d.Microseconds()) / float64(r.bare.e2e.n) }
		s.set("bare_msgs_per_s", r.bare.e2e.perSecond())
		s.set("e2e_vs_bare", ratio(own.e2e.perSecond(), r.bare.e2e.perSecond()))
		s.set("bare_pg_cpu_us_per_msg", perMsg(r.bare.e2e.cpu.postgres))
		s.set("bare_go_cpu_us_per_msg", perMsg(r.bare.e2e.cpu.bench))
		s.set("bare_duplicates", float64(r.bare.check.duplicates))
		if o := r.ordered.e2e; o.n > 0 {
			s.set("ordered_msgs_per_s", o.perSecond())
			s.set("ordered_vs_bare", ratio(o.perSecond(), r.bare.e2e.perSecond()))
			s.set("e2e_vs_ordered", ratio(own.e2e.perSecond(), o.perSecond()))
			s.set("ordered_pg_cpu_us_per_msg", float64(o.cpu.postgres.Microseconds())/float64(o.n))
		}
		if own.e2e.stmts != nil && r.bare.e2e.stmts != nil {
			s.set("e2e_pg_exec_us_per_msg", own.e2e.perMsg(topLevel(own.e2e.stmts)))
			s.set("bare_pg_exec_us_per_msg", r.bare.e2e.perMsg(topLevel(r.bare.e2e.stmts)))
		}
	}
	if r.wide != nil {
		s.set("e2e_p64_msgs_per_s", r.wide.e2e.perSecond())
		s.set("ingest_p64_msgs_per_s", r.wide.ingest.perSecond())
		s.set("dispatch_p64_msgs_per_s", r.wide.dispatch.perSecond())
		s.set("e2e_p64_vs_p4", ratio(r.wide.e2e.perSecond(), own.e2e.perSecond()))
		s.set("ingest_p64_vs_p4", ratio(r.wide.ingest.perSecond(), own.ingest.perSecond()))
		s.set("dispatch_p64_vs_p4", ratio(r.wide.dispatch.perSecond(), own.dispatch.perSecond()))
		s.set("p64_rss_mb", float64(r.wide.hwm)/(1<<20))
	}
}

// durabilityRows adds the THROUGHPUT table's rows of the bare queue and of
// the scenario on widePartitions partitions, those that were measured.
func (r *results) durabilityRows(row func(who, phase, keys string, backlog int, rt rate)) {
	if r.wide != nil {
		p := fmt.Sprintf(", %d partitions", r.wide.partitions)
		row("scheduler", "ingest"+p, r.wide.shape.name, 0, r.wide.ingest)
		row("scheduler", "dispatch"+p, r.wide.shape.name, 0, r.wide.dispatch)
		row("scheduler", "end to end"+p, r.wide.shape.name, 0, r.wide.e2e)
	}
	if r.bare.e2e.n > 0 {
		row("bare queue", "end to end", "own", 0, r.bare.e2e)
	}
	if r.ordered.e2e.n > 0 {
		row("ordered bare queue", "end to end", "own", 0, r.ordered.e2e)
	}
}

// writeDurability writes the PARTITIONS and BARE DURABLE QUEUE sections, of
// what was measured.
func (r *results) writeDurability(w io.Writer, v map[string]float64) {
	own := r.scenarios[0]
	if r.wide != nil {
		fmt.Fprintf(w, "\nPARTITIONS (the service, own keys, no far-future rows, %s messages per phase: every topic with %d partitions, then %d)\n",
			group(float64(r.cfg.N)), r.cfg.Partitions, r.wide.partitions)
		tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintf(tw, "phase\t%d partitions\t%d partitions\t%d / %d\t\n", r.cfg.Partitions, r.wide.partitions, r.wide.partitions, r.cfg.Partitions)
		for _, ph := range []struct {
			name       string
			narrow, wd rate
		}{{"ingest", own.ingest, r.wide.ingest}, {"dispatch", own.dispatch, r.wide.dispatch}, {"end to end", own.e2e, r.wide.e2e}} {
			fmt.Fprintf(tw, "%s\t%s msgs/s\t%s msgs/s\t%.2f\t\n", ph.name, group(ph.narrow.perSecond()), group(ph.wd.perSecond()),
				ratio(ph.wd.perSecond(), ph.narrow.perSecond()))
		}
		tw.Flush()
		fmt.Fprintf(w, "On %d partitions the service's peak RSS was %.1f MB (%.1f MB on %d).\n",
			r.wide.partitions, float64(r.wide.hwm)/(1<<20), float64(own.hwm)/(1<<20), r.cfg.Partitions)
	}
	if r.bare.e2e.n > 0 {
		fmt.Fprintln(w, "\nBARE DURABLE QUEUE (what durability alone costs: the end-to-end phase's records through one table, written once and")
		fmt.Fprintln(w, "deleted once per message, with the service's Kafka clients and batch sizes, in this process; CPU µs per message)")
		tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "contender\tmsgs/s\tPostgres\tservice\tthis process\ttotal\t")
		perMsg := func(d time.Duration, n int64) float64 { return float64(d.Microseconds()) / float64(max(n, 1)) }
		for _, c := range []struct {
			who string
			rt  rate
		}{{"scheduler", own.e2e}, {"bare queue", r.bare.e2e}, {"ordered bare queue", r.ordered.e2e}} {
			if c.rt.n == 0 {
				continue
			}
			cpu := c.rt.cpu
			fmt.Fprintf(tw, "%s\t%s\t%.0f\t%.0f\t%.0f\t%.0f\t\n", c.who, group(c.rt.perSecond()), perMsg(cpu.postgres, c.rt.n),
				perMsg(cpu.service, c.rt.n), perMsg(cpu.bench, c.rt.n), perMsg(cpu.postgres+cpu.service+cpu.bench, c.rt.n))
		}
		tw.Flush()
		fmt.Fprintf(w, "end to end / bare queue: %.2f. \"this process\" holds kfake and the load generators for both, and the bare queue itself.\n",
			v["e2e_vs_bare"])
		if r.ordered.e2e.n > 0 {
			fmt.Fprintf(w, "Ordered bare queue / bare queue: %.2f; end to end / ordered bare queue: %.2f. The ordered bare queue keeps per-key order\n",
				v["ordered_vs_bare"], v["e2e_vs_ordered"])
			fmt.Fprintln(w, "on the message row: a head flag, a unique head index per key, the due-time index on heads only, and the key's next")
			fmt.Fprintln(w, "message made its head in the claim's statement; no lease, history, parking or fairness.")
		}
		fmt.Fprintf(w, "Bare queue: per partition, batches of up to %s records / %v stored with their offsets in one statement; %d loops,\n",
			group(ingestBatch), bareLinger, dispatchLoops)
		fmt.Fprintf(w, "each in one transaction: delete up to %d due rows (FOR UPDATE SKIP LOCKED) returning them, publish, commit.\n", claimKeys)
		fmt.Fprintf(w, "%s of %s messages delivered, %s duplicates.\n", group(float64(r.bare.check.delivered)),
			group(float64(r.bare.check.expected)), group(float64(r.bare.check.duplicates)))
		writeStatements(w, "WHERE POSTGRES'S TIME GOES (end to end, own keys: each statement's executor time per message, pg_stat_statements;\n"+
			"wall time, lock waits and time off the CPU included. \"inside\" are statements run by triggers and functions:\n"+
			"their time is already in the statement that ran them)",
			[]stmtPhase{{"scheduler", own.e2e.n, own.e2e.stmts}, {"bare queue", r.bare.e2e.n, r.bare.e2e.stmts},
				{"ordered bare queue", r.ordered.e2e.n, r.ordered.e2e.stmts}})
	}
}

// summarizeOnlyDurability is summary for BENCH_ONLY=bare and
// BENCH_ONLY=partitions.
func (r *results) summarizeOnlyDurability(s *summary) {
	own := r.scenarios[0]
	s.set("e2e_msgs_per_s", own.e2e.perSecond())
	s.set("dispatch_msgs_per_s", own.dispatch.perSecond())
	s.set("ingest_msgs_per_s", own.ingest.perSecond())
	perMsg := func(d time.Duration) float64 { return float64(d.Microseconds()) / float64(max(own.e2e.n, 1)) }
	s.set("e2e_cpu_us_per_msg", perMsg(own.e2e.cpu.service+own.e2e.cpu.postgres+own.e2e.cpu.bench))
	s.set("e2e_pg_cpu_us_per_msg", perMsg(own.e2e.cpu.postgres))
	s.set("e2e_svc_cpu_us_per_msg", perMsg(own.e2e.cpu.service))
	own.summarizeLateness(s)
	r.summarizeDurability(s)
	var delivered, expected, outOfOrder, dupes int
	checked := r.scenarios
	if r.wide != nil {
		checked = slices.Concat(r.scenarios, []scenario{*r.wide})
	}
	for _, sc := range checked {
		for _, c := range sc.checks {
			delivered += c.delivered
			expected += c.expected
			outOfOrder += c.outOfOrder
			dupes += c.duplicates
		}
	}
	s.set("cpu_speed_start", r.speedStart)
	s.set("cpu_speed_end", r.speedEnd)
	s.set("messages_per_phase", float64(r.cfg.N))
	s.set("delivered", float64(delivered))
	s.set("expected", float64(expected))
	s.set("out_of_order", float64(outOfOrder))
	s.set("duplicates", float64(dupes))
}

// writeOnlyDurability is write for BENCH_ONLY=bare and
// BENCH_ONLY=partitions.
func (r *results) writeOnlyDurability(w io.Writer, s *summary) {
	cfg := r.cfg
	fmt.Fprintf(w, "\ndefer-scheduler benchmark, mode %s, BENCH_ONLY=%s: %s messages per measured phase (after %s of warm-up), %d partitions per topic\n",
		cfg.Mode, cfg.Only, group(float64(cfg.N)), group(float64(cfg.Warmup)), cfg.Partitions)
	for _, m := range r.machine {
		fmt.Fprintln(w, m)
	}
	fmt.Fprintln(w, "\nTHROUGHPUT (CPU seconds spent meanwhile: the service process, all Postgres processes, this process with kfake and the load generators)")
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "contender\tphase\tkeys\tmsgs\twall\tmsgs/s\tCPU svc\tCPU pg\tCPU bench\t")
	row := func(who, phase, keys string, _ int, rt rate) {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%.2fs\t%s\t%.1f\t%.1f\t%.1f\t\n", who, phase, keys,
			group(float64(rt.n)), rt.wall.Seconds(), group(rt.perSecond()),
			rt.cpu.service.Seconds(), rt.cpu.postgres.Seconds(), rt.cpu.bench.Seconds())
	}
	own := r.scenarios[0]
	row("scheduler", "ingest", own.shape.name, 0, own.ingest)
	row("scheduler", "dispatch", own.shape.name, 0, own.dispatch)
	row("scheduler", "end to end", own.shape.name, 0, own.e2e)
	r.durabilityRows(row)
	tw.Flush()
	writeLateness(w, cfg, []lateRow{{"scheduler", own.late}, {"scheduler, after a VACUUM", own.lateVacuumed}})
	r.writeDurability(w, s.vals)
	v := s.vals
	fmt.Fprintln(w, "\nCOMPARED WITH THE TARGETS")
	tw = tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)
	target := targetRow(tw)
	if own.late != nil {
		latenessTargets(target, cfg, v)
	}
	durabilityTargets(target, v)
	tw.Flush()
	fmt.Fprintf(w, "\nCHECKS: %s of %s messages of the service delivered (read back from every target topic), %s out of per-key order, %s duplicates\n",
		group(v["delivered"]), group(v["expected"]), group(v["out_of_order"]), group(v["duplicates"]))
	fmt.Fprintln(w, s.resultLine())
}
