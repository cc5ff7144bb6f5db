-- deferred_require_read_committed refuses a change of table (a trigger's
-- TG_TABLE_NAME) unless the transaction is READ COMMITTED. The triggers
-- that keep deferred_key's heads call it first.
--
-- They lock the rows of the keys they touch and then read deferred_message
-- again, on a snapshot taken after the locks, so that a message another
-- transaction stored meanwhile is seen (deferred_key_refresh.sql). Under
-- REPEATABLE READ or SERIALIZABLE every statement of a transaction reads
-- the snapshot of its first, so the second read misses that message: an
-- operator's DELETE of a key's head, in a REPEATABLE READ transaction,
-- while ingest stored the key's next message, deleted the key's row and
-- left the new message pending with no head, never to be published
-- (migration 0020). A database or role whose default_transaction_isolation
-- is stricter gets this error on the first write, with the fix, instead of
-- messages that wait for ever. The service, the console and the operator
-- commands ask for READ COMMITTED when they connect (README, "Session
-- settings"); psql and the runbook files follow the server's default.
--
-- READ UNCOMMITTED is READ COMMITTED in PostgreSQL. SQLSTATE 0A000
-- (feature_not_supported): nothing is wrong with the statement but its
-- transaction's isolation.
CREATE OR REPLACE FUNCTION deferred_require_read_committed(changed text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('transaction_isolation') NOT IN ('read committed', 'read uncommitted') THEN
        RAISE EXCEPTION 'the scheduler''s table % can be changed only in a READ COMMITTED transaction; this transaction is %',
                        changed, upper(current_setting('transaction_isolation'))
            USING ERRCODE = 'feature_not_supported',
                  HINT = 'Its triggers keep each key''s head by locking and reading again, which needs every statement''s own '
                         'snapshot. Run the change in BEGIN ISOLATION LEVEL READ COMMITTED, or remove default_transaction_isolation '
                         'from the connection''s, role''s or database''s settings.';
    END IF;
END
$$;
