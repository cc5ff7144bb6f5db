-- Claim up to $1 due heads that no one holds, lease them to $4 until now() +
-- $2, and return, for each, its consecutive due pending messages in order (at
-- most $3 per key; unordered heads are one message), within $5 bytes in all
-- (see "The byte budget" below). The lease commits with this statement:
-- publishing happens after, outside any transaction. This is the main claim:
-- heads of every target that is neither paused nor rate-limited. A
-- rate-limited target's heads are claimed with dispatch_claim_target.sql.
-- The two are separate statements only so that each names its partial
-- index's predicate (deferred_key.throttled) as a constant (see
-- internal/keylock's claim); what they read once the heads are leased must
-- not differ, since per-key order, the byte budget and the release of keys
-- that come back empty rest on it. So from "claimed AS" on that file is this
-- one word for word (TestClaimStatementsShareTheirMessageRead checks it),
-- which is also why the budget is $5 in both.
--
-- Fair between targets: the $1 heads are shared round-robin between the
-- targets that have due heads, so that one target's backlog cannot delay
-- another target's due messages (docs/design.md, "Fairness between
-- targets"). Each target's due heads are read in due-time order from
-- deferred_key_target_due, at most $6 per unit of its weight
-- (target_control.weight, 1 without a row; $6 is the caller's estimate of
-- a target's share, see internal/keylock's share; never more than $1),
-- locked as they are read (SKIP LOCKED, so concurrent claims take the next
-- ones). Then they are taken turn by turn: every target's earliest due
-- heads, as many as its weight, then every target's next ones, and so on,
-- earlier due time first within a turn, until $1. A target with fewer due
-- heads than its share leaves the rest to the others, so one target alone
-- gets the whole round. Heads read and locked but not taken stay as they
-- were (the lock ends with the statement); keylock's share keeps them few.
-- The weight is read from its row by the primary key, once per target.
--
-- Two LIMITs, on purpose: the inner one, $1, is what the planner estimates
-- the read by; the outer one, which names the weight, is what the read
-- stops at (rows are locked only as they are pulled through it). A LIMIT
-- that names a column cannot be estimated, so the planner takes a tenth of
-- the target's due heads: with 200,000 heads of one target due and
-- analyzed, the claim was costed at 274,000, above jit_above_cost, and
-- every claim spent about 110 ms compiling itself for a 15 ms read
-- (docs/benchmarks.md, "The claim compiled by JIT").
--
-- The targets come from the view deferred_key_target, a loose scan of
-- deferred_key_target_due (one index probe per target that has heads there), so the claim costs a few probes
-- per target however long any target's backlog is. A target's due heads
-- are read from deferred_key_target_due only: deferred_key_due, which also
-- holds them in due order, has the predicate next_run_at < 'infinity',
-- which this statement does not state, so it cannot be planned on it (with
-- it, the planner took it whenever statistics said the due range was
-- short, and walked every other target's due heads; migration 0009). The
-- due-time test is the bare next_run_at <= now() on purpose: written as a
-- row comparison on (head_target, next_run_at), PostgreSQL 15 did not end
-- the index scan at now() and read every far-future head of the target.
-- TestClaimDoesNotWalkAnotherTargetsBacklog counts the rows read.
-- Heads of paused and rate-limited targets are flagged (deferred_key.throttled)
-- and are not in deferred_key_target_due at all, so however large their
-- backlog, this walks only heads that can go. The target_control check
-- below is a safety net, not the filter: a head written while an operator
-- was pausing or limiting its target may be left unflagged for a while (see
-- "Throttled heads under concurrency" in migration 0002); the check still
-- keeps it from being sent, at the cost of a skipped target. It reads
-- target_control once, into an array.
--
-- A key held by a parked message (deferred_key.held) has next_run_at =
-- 'infinity' and is never due, so the range scans below never reach it. A
-- run stops at the first message that is not due, and also at a parked
-- message that holds the key: the head is pending, but a later message
-- must still not overtake a parked one ahead of it.
--
-- MATERIALIZED keeps the LIMITs and SKIP LOCKED in one place: without it the
-- planner may inline the CTE into the UPDATE and lock more rows than asked.
-- A claimed key for which no message comes back (an operator changed it an
-- instant ago, or the byte budget cut all of its run) still returns one row
-- with id NULL so the caller can release it.
--
-- The byte budget ($5, bigint, at least 1) bounds what the caller holds in
-- memory. A message's bytes are octet_length(key) + octet_length(value) +
-- the octet_length of each header value (NULLs count 0; octet_length reads
-- a TOASTed value's size from its pointer, without fetching it). Rows are
-- summed in the order they are returned (business key, head, seq, id), and
-- a row is kept only while the bytes of the rows before it are below $5:
-- the first message always comes back, however large, and no claim returns
-- more than $5 bytes plus one message. What is kept is a prefix of that order, so a key
-- cut part-way returns the first messages of its run, in order, and the
-- rest stays pending behind them, to be claimed again from the new head
-- once the caller releases the key; a key cut entirely returns its id NULL
-- row, whose columns are all NULL (nothing of the cut messages leaves the
-- database). The sum runs over the rows the laterals read, at most $1 x $3,
-- in the sort the output order needs anyway; nth, each message's place in
-- its run, rides on the window that already checks all_due.
WITH candidate AS MATERIALIZED (
    SELECT h.ctid, h.next_run_at,
           (row_number() OVER (PARTITION BY t.target ORDER BY h.next_run_at) - 1) / coalesce(w.weight, 1) AS turn
    FROM deferred_key_target t
    LEFT JOIN target_control w ON w.target_topic = t.target
    CROSS JOIN LATERAL (
        SELECT l.ctid, l.next_run_at
        FROM (
            SELECT k.ctid, k.next_run_at
            FROM deferred_key k
            WHERE NOT k.throttled
              AND k.head_target = t.target
              AND k.next_run_at <= now()
              AND (k.leased_until IS NULL OR k.leased_until <= now())
            ORDER BY k.next_run_at
            LIMIT $1
            FOR UPDATE SKIP LOCKED
        ) l
        LIMIT least($1::int, $6::int * coalesce(w.weight, 1))
    ) h
    WHERE coalesce(t.target <> ALL (ARRAY(SELECT c.target_topic FROM target_control c
                                          WHERE c.paused OR c.rate_limit IS NOT NULL)), false)
), due AS MATERIALIZED (
    SELECT ctid
    FROM candidate
    ORDER BY turn, next_run_at
    LIMIT $1
), claimed AS (
    -- The heads by their ctids, which a TID scan reads directly, whatever
    -- the size of deferred_key. Written as a join (FROM due WHERE k.ctid =
    -- due.ctid), it was planned as a hash join over a sequential scan of
    -- every head, up to about 65,000 keys: a third of a claim's time at
    -- 20,000 (docs/benchmarks.md, "Three plans fixed"). A version
    -- newer than this statement's snapshot is not visible to the TID scan
    -- either, so a head that changed since is skipped, as by the join.
    UPDATE deferred_key k
    SET leased_until = now() + $2::interval, leased_by = $4::text
    WHERE k.ctid = ANY (ARRAY(SELECT ctid FROM due))
    RETURNING k.business_key, k.head_id, k.head_seq
), run AS (
    SELECT c.business_key, c.head_id, m.id, m.seq, m.target_topic, m.next_run_at, m.attempt, m.redrive_count,
           m.key, m.value, m.header_keys, m.header_values, m.group_id, m.nth,
           -- The bytes of the rows before this one, in the output order.
           coalesce(sum(coalesce(octet_length(m.key), 0) + coalesce(octet_length(m.value), 0)
                        + coalesce((SELECT sum(octet_length(h)) FROM unnest(m.header_values) AS h)::int, 0))
                    OVER (ORDER BY c.business_key, c.head_id, m.seq, m.id
                          ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS bytes_before
    FROM claimed c
    LEFT JOIN LATERAL (
        SELECT s.id, s.seq, s.target_topic, s.next_run_at, s.attempt, s.redrive_count, s.key, s.value,
               s.header_keys, s.header_values, s.group_id, s.nth
        FROM (
            SELECT m.*, bool_and(m.state = 'pending' AND m.next_run_at <= now()) OVER w AS all_due,
                   row_number() OVER w AS nth
            FROM deferred_message m
            WHERE c.business_key IS NOT NULL AND m.business_key = c.business_key
              -- The head candidates (deferred_message_key_order's predicate),
              -- so that a parked message holding the key ends the run.
              AND (m.state = 'pending' OR (m.state = 'parked' AND m.park_holds_key))
              -- Never hand out anything before the head the claim leased. The
              -- ctid match above already skips a head that changed after this
              -- statement's snapshot; this keeps the read right even if that
              -- match changes.
              AND (m.seq, m.id) >= (c.head_seq, c.head_id)
            WINDOW w AS (ORDER BY m.seq, m.id)
            ORDER BY m.seq, m.id
            LIMIT $3
        ) s
        WHERE s.all_due
        UNION ALL
        SELECT m.id, m.seq, m.target_topic, m.next_run_at, m.attempt, m.redrive_count, m.key, m.value,
               m.header_keys, m.header_values, m.group_id, 1
        FROM deferred_message m
        -- IS TRUE: by the primary key, never by a walk of the partial
        -- deferred_message_key_order (see dispatch_delete.sql).
        WHERE c.business_key IS NULL AND m.id = c.head_id AND (m.state = 'pending') IS TRUE AND m.next_run_at <= now()
    ) m ON true
)
-- Past the budget, a key's first row stays, emptied, so that the key comes
-- back (nth is NULL on the row of a key with no message at all).
--
-- target_weight is the weight of each message's target (target_control;
-- 1 without a row), from which internal/keylock's nextShare sizes what the
-- next main claim reads of each target.
--
-- claimed_at is this statement's now(), the database's clock at the claim:
-- the finalize records each delivery's 'published' event at it, not at its
-- own now(). A consumer can read the record, re-defer it and ingest store
-- the re-deferral before the finalize starts; recorded at the finalize,
-- the delivery came after the deferral it caused in the history. Every
-- consequence of the publish starts after this claim committed, on the same
-- clock (docs/design.md section 3.5).
SELECT r.business_key, r.head_id, now() AS claimed_at,
       CASE WHEN r.bytes_before < $5::bigint THEN r.id END AS id,
       CASE WHEN r.bytes_before < $5::bigint THEN r.seq END AS seq,
       CASE WHEN r.bytes_before < $5::bigint THEN r.target_topic END AS target_topic,
       CASE WHEN r.bytes_before < $5::bigint THEN r.next_run_at END AS next_run_at,
       CASE WHEN r.bytes_before < $5::bigint THEN r.attempt END AS attempt,
       CASE WHEN r.bytes_before < $5::bigint THEN r.redrive_count END AS redrive_count,
       CASE WHEN r.bytes_before < $5::bigint THEN r.key END AS key,
       CASE WHEN r.bytes_before < $5::bigint THEN r.value END AS value,
       CASE WHEN r.bytes_before < $5::bigint THEN r.header_keys END AS header_keys,
       CASE WHEN r.bytes_before < $5::bigint THEN r.header_values END AS header_values,
       CASE WHEN r.bytes_before < $5::bigint THEN r.group_id END AS group_id,
       coalesce(w.weight, 1) AS target_weight
FROM run r
LEFT JOIN target_control w ON w.target_topic = r.target_topic
WHERE r.bytes_before < $5::bigint OR coalesce(r.nth, 1) = 1
ORDER BY r.business_key, r.head_id, r.seq, r.id
